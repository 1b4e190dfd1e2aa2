"""Chunked LM-head cross-entropy: exact against the unchunked loss, small memory, shardable."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.model.xent import cross_entropy, lm_logits

B, S, D, V = 2, 13, 16, 50  # 26 tokens
RTOL = 1e-5


def _inputs(b=B, s=S, d=D, v=V, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(ks[0], (b, s, d), jnp.float32)
    embedding = jax.random.normal(ks[1], (v, d), jnp.float32)
    labels = jax.random.randint(ks[2], (b, s), 0, v)
    weights = jax.random.uniform(ks[3], (b, s))
    return hidden, embedding, labels, weights


def _reference_loss(hidden, embedding, labels):
    """Independent reference: full logits, gather of the label's logit."""
    logits = lm_logits(hidden, embedding)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _loss_and_grads(loss_fn, hidden, embedding, labels, weights):
    def total(h, e):
        per_token = loss_fn(h, e, labels)
        return jnp.sum(per_token * weights), per_token

    (_, per_token), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(
        hidden, embedding
    )
    return per_token, grads


@pytest.fixture(scope="module")
def reference():
    args = _inputs()
    return args, _loss_and_grads(_reference_loss, *args)


def _assert_close(got, want):
    """(loss, (dhidden, dembed)) against the float32 reference: same dtypes and shapes."""
    assert_close(got, want, rtol=RTOL, scaled_atol=True, dtypes=True)


@pytest.mark.parametrize(
    "chunk", [None, 1, 5, 13, 26, 100], ids=["none", "1", "5-partial", "13", "all", "larger"]
)
def test_chunked_equals_plain(reference, chunk):
    args, want = reference

    def loss_fn(h, e, y):
        return cross_entropy(h, e, y, chunk=chunk)

    _assert_close(_loss_and_grads(loss_fn, *args), want)


def test_chunked_bfloat16_hidden_matches_unchunked():
    hidden, embedding, labels, _ = _inputs(seed=1)
    hidden = hidden.astype(jnp.bfloat16)
    got = jax.jit(lambda h, e: cross_entropy(h, e, labels, chunk=7))(hidden, embedding)
    want = cross_entropy(hidden, embedding, labels)
    np.testing.assert_allclose(got, want, rtol=RTOL)


def test_chunked_program_holds_one_chunk_of_logits():
    """Forward + backward with 4096 tokens x 8192 vocab: no [tokens, V] buffer; the chunked
    program's temp memory is a small fraction of the unchunked one's."""
    tokens, d, v, chunk = 4096, 64, 8192, 512
    args = (
        jax.ShapeDtypeStruct((1, tokens, d), jnp.float32),
        jax.ShapeDtypeStruct((v, d), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
        jax.ShapeDtypeStruct((1, tokens), jnp.float32),
    )

    def compiled(c):
        def f(h, e, y, ct):
            _, vjp = jax.vjp(lambda h, e: cross_entropy(h, e, y, chunk=c), h, e)
            return vjp(ct)

        return jax.jit(f).lower(*args).compile()

    plain, chunked = compiled(None), compiled(chunk)
    assert f"{tokens},{v}" in plain.as_text()
    hlo = chunked.as_text()
    assert f"{tokens},{v}" not in hlo and "conditional" not in hlo
    for line in (x for x in hlo.splitlines() if re.search(r"\swhile\(", x)):
        assert f'"known_trip_count":{{"n":"{tokens // chunk}"}}' in line, line
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    chunked_temp = chunked.memory_analysis().temp_size_in_bytes
    assert chunked_temp * 4 < plain_temp, (chunked_temp, plain_temp)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_sharded_vocab_and_batch(axis_type):
    """Batch over data x fsdp, vocabulary over model: equal to the unsharded reference, and the
    chunk loop moves no activations (only all-reduces: the vocabulary-sharded log-sum-exp and
    the gradient reductions)."""
    axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types)
    hidden, embedding, labels, weights = _inputs(b=4, s=16, v=64, seed=2)
    want = _loss_and_grads(_reference_loss, hidden, embedding, labels, weights)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    hidden, labels, weights = (jax.device_put(x, batch) for x in (hidden, labels, weights))
    embedding = jax.device_put(embedding, NamedSharding(mesh, P("model")))

    def total(h, e):
        per_token = cross_entropy(h, e, labels, chunk=16)
        return jnp.sum(per_token * weights), per_token

    fn = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))
    hlo = fn.lower(hidden, embedding).compile().as_text()
    (_, per_token), grads = fn(hidden, embedding)
    _assert_close((per_token, grads), want)
    assert not re.search(r"(all-gather|all-to-all|collective-permute)\(", hlo)


def test_bad_chunk():
    hidden, embedding, labels, _ = _inputs()
    with pytest.raises(ValueError, match="chunk=0"):
        cross_entropy(hidden, embedding, labels, chunk=0)


@pytest.mark.parametrize("groups", [1, 4])
def test_grouped_embedding_gradient_reduced_after_the_loop(groups):
    """groups = the batch shards (4 = data x fsdp): equal to the reference, and inside the chunk
    loop no collective as large as the embedding gradient shard ([32, 16] float32, 2 KiB); with
    one group XLA reduces it there on every chunk."""
    from trn_accum.analysis.collectives import collectives
    from trn_accum.model.sharding import batch_groups, shard_activation

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), (jax.sharding.AxisType.Auto,) * 3)
    hidden, embedding, labels, weights = _inputs(b=4, s=16, v=64, seed=3)
    want = _loss_and_grads(_reference_loss, hidden, embedding, labels, weights)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    hidden, labels, weights = (jax.device_put(x, batch) for x in (hidden, labels, weights))
    embedding = jax.device_put(embedding, NamedSharding(mesh, P("model")))

    def total(h, e):
        per_token = cross_entropy(h, e, labels, chunk=16, groups=groups, shard=shard_activation)
        return jnp.sum(per_token * weights), per_token

    fn = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))
    with jax.set_mesh(mesh):
        assert batch_groups(16) == 4
        hlo = fn.lower(hidden, embedding).compile().as_text()
        (_, per_token), grads = fn(hidden, embedding)
    _assert_close((per_token, grads), want)
    in_loop = [c.bytes for c in collectives(hlo) if c.in_loop]
    assert (max(in_loop) >= 32 * 16 * 4) == (groups == 1), in_loop
