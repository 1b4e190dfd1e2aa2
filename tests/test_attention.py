"""Attention implementations: blockwise, flash and the NKI-kernel adapter against the plain
reference."""

import dataclasses
import functools
import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import PartitionSpec as P

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.mesh import build_mesh
from trn_accum.model import attention as attn_lib
from trn_accum.model.attention import attention, blockwise_attention
from trn_accum.model.flash import flash_attention
from trn_accum.model.xent import cross_entropy
from trn_accum.neuron import kernels as nki_kernels
from trn_accum.neuron import preflight
from trn_accum.neuron.kernels import nki_flash_attention

B, S, H, KV, DH = 2, 24, 4, 2, 16
# float32, rtol 1e-5; plus an absolute 1e-5 of the array's largest entry, for entries that are
# zero in exact arithmetic (e.g. dq of the first query, whose softmax is constant) and so differ
# by rounding noise only.
RTOL = 1e-5


def _inputs(b=B, s=S, h=H, kv=KV, dh=DH, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, h, dh), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, kv, dh), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, kv, dh), jnp.float32)
    ct = jax.random.normal(ks[3], (b, s, h, dh), jnp.float32)
    return q, k, v, ct


def _kv_mask(b, s):
    """Padding mask with holes and right padding; key 0 always valid (no query sees nothing)."""
    m = np.ones((b, s), bool)
    m[0, [3, 10, 11]] = False
    m[-1, s - 5 :] = False
    return jnp.asarray(m)


def _out_and_grads(fn, q, k, v, ct):
    """(output, (dq, dk, dv)) of sum(fn(q, k, v) * ct), jitted."""

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(got, want):
    """(out, (dq, dk, dv)), each leaf within RTOL of its largest entry."""
    assert_close(got, want, rtol=RTOL, scaled_atol=True)


@pytest.fixture(scope="module")
def masked_reference():
    q, k, v, ct = _inputs()
    mask = _kv_mask(B, S)
    want = _out_and_grads(lambda q, k, v: attention(q, k, v, kv_mask=mask), q, k, v, ct)
    return (q, k, v, ct, mask), want


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
@pytest.mark.parametrize("block", [8, 7, 64], ids=["divides", "ragged", "larger-than-S"])
def test_pure_jax_attention_equals_plain_gqa_with_padding_mask(masked_reference, impl, block):
    (q, k, v, ct, mask), want = masked_reference
    fn = functools.partial(attention, impl=impl, block_size=block, kv_mask=mask)
    _assert_close(_out_and_grads(fn, q, k, v, ct), want)


@pytest.mark.parametrize("block, chunk", [(7, 5), (8, 16), (5, 11)])
def test_flash_chunks_equal_plain(masked_reference, block, chunk):
    """Rows and columns cut into `chunk`-token pieces (online softmax across them), none of
    them aligned with S=24 or with each other: the same output and gradients."""
    (q, k, v, ct, mask), want = masked_reference
    fn = functools.partial(flash_attention, kv_mask=mask, block_size=block, chunk=chunk)
    _assert_close(_out_and_grads(fn, q, k, v, ct), want)


@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(blockwise_attention, block_size=6),
        functools.partial(flash_attention, block_size=6, chunk=8),
    ],
    ids=["blockwise", "flash"],
)
def test_pure_jax_attention_equals_plain_mha_no_mask(fn):
    q, k, v, ct = _inputs(h=2, kv=2, s=20, seed=1)
    want = _out_and_grads(attention, q, k, v, ct)
    _assert_close(_out_and_grads(fn, q, k, v, ct), want)


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
def test_pure_jax_attention_bfloat16_close_to_plain(impl):
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(seed=2))
    got = jax.jit(functools.partial(attention, impl=impl, block_size=8))(q, k, v)
    assert got.dtype == jnp.bfloat16
    want = attention(q, k, v)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2)


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
def test_query_that_sees_no_key_gives_zeros(impl):
    """Key 0 masked: query 0 of row 0 sees nothing; its output and every gradient through it
    are zero (the documented convention), and nothing is NaN."""
    q, k, v, ct = _inputs(s=10, seed=6)
    mask = jnp.ones((B, 10), bool).at[0, 0].set(False)
    fn = functools.partial(attention, impl=impl, block_size=4, kv_mask=mask)
    out, (dq, dk, dv) = _out_and_grads(fn, q, k, v, ct)
    assert not any(np.isnan(x).any() for x in (out, dq, dk, dv))
    np.testing.assert_array_equal(out[0, 0], 0.0)
    np.testing.assert_array_equal(dq[0, 0], 0.0)
    np.testing.assert_array_equal(dk[0, 0], 0.0)  # key 0 of row 0: no query reads it
    np.testing.assert_array_equal(dv[0, 0], 0.0)


S_BIG, BLOCK_BIG = 1024, 128


def _fwd_bwd_lowered(impl, s=S_BIG):
    """Forward + backward at S=s, block 128, lowered."""
    spec = jax.ShapeDtypeStruct((1, s, 4, 32), jnp.float32)
    kv_spec = jax.ShapeDtypeStruct((1, s, 2, 32), jnp.float32)

    def f(q, k, v, ct):
        fn = functools.partial(attention, impl=impl, block_size=BLOCK_BIG)
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(ct)

    return jax.jit(f).lower(spec, kv_spec, kv_spec, spec)


def _fwd_bwd_compiled(impl, s=S_BIG):
    return _fwd_bwd_lowered(impl, s).compile()


@pytest.fixture(scope="module")
def plain_temp_bytes():
    compiled = _fwd_bwd_compiled("plain")
    assert f"{S_BIG},{S_BIG}" in compiled.as_text()  # the checks below can see a score matrix
    return compiled.memory_analysis().temp_size_in_bytes


def _whiles(hlo):
    return [line for line in hlo.splitlines() if re.search(r"\swhile\(", line)]


def test_blockwise_program_has_no_score_matrix_and_static_loops(plain_temp_bytes):
    """Forward + backward at S=1024: no [.., S, S] buffer, far less temp memory, static loops."""
    compiled = _fwd_bwd_compiled("blockwise")
    hlo = compiled.as_text()
    assert f"{S_BIG},{S_BIG}" not in hlo
    block_temp = compiled.memory_analysis().temp_size_in_bytes
    assert block_temp * 8 < plain_temp_bytes, (block_temp, plain_temp_bytes)
    assert "conditional" not in hlo
    whiles = _whiles(hlo)
    assert len(whiles) == 2  # one forward scan, one backward scan
    n_pairs = (S_BIG // BLOCK_BIG) * (S_BIG // BLOCK_BIG + 1) // 2  # causal block pairs only
    for line in whiles:
        assert f'"known_trip_count":{{"n":"{n_pairs}"}}' in line, line


def test_flash_program_is_loop_free_and_small(plain_temp_bytes):
    """Forward + backward at S=1024: no [.., S, S] buffer, no loop, no conditional, no
    dynamic-update-slice (the Neuron preflight finds nothing), 14 n - 7 dots for n query blocks
    (forward: the row's block and, right of row 0, the keys left of it, two dots each; backward:
    five per piece); memory that grows with S * block, not S^2, from S=256 to 1024.

    Memory is the estimate the dry-run fits (`peak_live_bytes` of the partitioned module, in
    which the optimization barriers order the rows). XLA:CPU removes the barriers before it
    schedules (OptimizationBarrierExpander), so its own temporaries are held to less than half
    of plain's only."""
    from trn_accum.analysis.hlo.partitioned import compile_partitioned
    from trn_accum.analysis.live_bytes import peak_live_bytes

    compiled, text = compile_partitioned(_fwd_bwd_lowered("flash"))
    hlo = compiled.as_text()
    assert f"{S_BIG},{S_BIG}" not in hlo
    assert compiled.memory_analysis().temp_size_in_bytes * 2 < plain_temp_bytes
    assert not _whiles(hlo) and "conditional" not in hlo
    assert "dynamic-update-slice" not in hlo
    assert preflight.preflight(hlo) == []
    n = S_BIG // BLOCK_BIG
    assert len(re.findall(r"\sdot\(", text)) == 14 * n - 7
    live = {
        s: peak_live_bytes(text if s == S_BIG else _partitioned("flash", s))
        for s in (256, 512, S_BIG)
    }
    assert live[S_BIG] < 2.5 * live[512] and live[512] < 2.5 * live[256], live  # S^2: 4x
    assert live[S_BIG] * 4 < peak_live_bytes(_partitioned("plain", S_BIG)), live


def _partitioned(impl, s):
    from trn_accum.analysis.hlo.partitioned import compile_partitioned

    return compile_partitioned(_fwd_bwd_lowered(impl, s))[1]


def _toy_loss(params, batch, *, impl, chunk):
    """Token-weighted mean cross-entropy of one attention layer + the tied LM head."""
    x = batch["x"]
    b, s, _ = x.shape
    q = (x @ params["wq"]).reshape(b, s, H, DH)
    k = (x @ params["wk"]).reshape(b, s, KV, DH)
    v = (x @ params["wv"]).reshape(b, s, KV, DH)
    ctx = attention(q, k, v, impl=impl, block_size=8).reshape(b, s, H * DH)
    per_token = cross_entropy(ctx @ params["wo"], params["embed"], batch["labels"], chunk=chunk)
    return jnp.sum(per_token * batch["mask"]) / jnp.sum(batch["mask"])


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
def test_pure_jax_attention_and_chunked_loss_inside_accumulation_wrapper(impl):
    """accumulate_gradients over 2 minibatches on a data x fsdp x model mesh, blockwise or flash
    attention and chunked loss == full-batch value_and_grad with plain attention and unchunked
    loss."""
    d, vocab, b, s = 16, 32, 8, 12
    ks = jax.random.split(jax.random.key(5), 7)
    params = {
        "wq": jax.random.normal(ks[0], (d, H * DH)) / 4,
        "wk": jax.random.normal(ks[1], (d, KV * DH)) / 4,
        "wv": jax.random.normal(ks[2], (d, KV * DH)) / 4,
        "wo": jax.random.normal(ks[3], (H * DH, d)) / 8,
        "embed": jax.random.normal(ks[4], (vocab, d)),
    }
    lengths = jnp.array([12, 3, 7, 12, 1, 9, 12, 5])  # uneven right padding
    batch = {
        "x": jax.random.normal(ks[5], (b, s, d)),
        "labels": jax.random.randint(ks[6], (b, s), 0, vocab),
        "mask": (jnp.arange(s)[None] < lengths[:, None]).astype(jnp.float32),
    }
    want_loss, want_grads = jax.jit(
        jax.value_and_grad(functools.partial(_toy_loss, impl="plain", chunk=None))
    )(params, batch)
    grad_fn = accumulate_gradients(
        functools.partial(_toy_loss, impl=impl, chunk=10),
        steps=2,
        mesh=build_mesh({"data": 2, "fsdp": 2, "model": 2}),
        batch_spec=P(("data", "fsdp")),
        weight_fn=lambda mb: jnp.sum(mb["mask"]),
    )
    loss, grads = jax.jit(grad_fn)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_close(grads, want_grads, rtol=RTOL, scaled_atol=True)


# ----------------------------------------------------------------------------------------------
# neuron_flash: the layout adapter with the pure-JAX stand-ins of the NKI Library training pair
# (attention_cte with cache_softmax, attention_bwd), which follow the kernels' documented IO.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lnc", [1, 2])
def test_nki_adapter_with_stand_ins_equals_blockwise(lnc):
    """Output and gradients equal blockwise; S=40 is padded to 128 (causal hides it); GQA 4:2;
    both kernels launched once each with the 1-D LNC grid."""
    q, k, v, ct = _inputs(s=40, seed=3)
    kernels = nki_kernels.reference_kernels()
    fn = functools.partial(nki_flash_attention, fwd=kernels["fwd"], bwd=kernels["bwd"], lnc=lnc)
    got = _out_and_grads(fn, q, k, v, ct)
    want = _out_and_grads(functools.partial(blockwise_attention, block_size=16), q, k, v, ct)
    _assert_close(got, want)
    assert kernels["fwd"].grids == [lnc] and kernels["bwd"].grids == [lnc]


@pytest.mark.parametrize("s, sp", [(200, 256), (640, 1024), (1152, 1536)])
def test_nki_adapter_pads_to_what_both_kernels_accept(s, sp):
    """S=200 pads to 256 (128s up to 512); 640 and 1152 pad to 512s (the backward's key tile),
    and output and gradients equal plain attention. Without the 512 rule the backward stand-in
    rejects 640 and 1152."""
    from trn_accum.model.attention import plain_attention

    assert nki_kernels.padded_seq_len(s) == sp
    q, k, v, ct = _inputs(b=1, s=s, h=2, kv=1, dh=8, seed=5)
    kernels = nki_kernels.reference_kernels()
    fn = functools.partial(nki_flash_attention, fwd=kernels["fwd"], bwd=kernels["bwd"], lnc=1)
    _assert_close(_out_and_grads(fn, q, k, v, ct), _out_and_grads(plain_attention, q, k, v, ct))


def test_nki_adapter_chunks_rows_beyond_the_forward_batch_limit():
    """B*H = 5 x 128 = 640 > 512 (the forward kernel asserts bs <= 512): the adapter runs rows
    in chunks of 512 // 128 = 4 (two kernel pairs), equal to plain attention."""
    from trn_accum.model.attention import plain_attention

    q, k, v, ct = _inputs(b=5, s=128, h=128, kv=64, dh=8, seed=7)
    kernels = nki_kernels.reference_kernels()
    fn = functools.partial(nki_flash_attention, fwd=kernels["fwd"], bwd=kernels["bwd"], lnc=1)
    _assert_close(_out_and_grads(fn, q, k, v, ct), _out_and_grads(plain_attention, q, k, v, ct))
    assert len(kernels["fwd"].grids) == 2 and len(kernels["bwd"].grids) == 2


def test_backward_stand_in_rejects_a_key_length_off_the_512_tile():
    b, h, d, s = 1, 1, 8, 640
    x = jnp.zeros((b, h, d, s), jnp.float32)
    lse = jnp.zeros((b, h, 128, s // 128), jnp.float32)
    with pytest.raises(AssertionError, match="seqlen_k 640 % key tile 512"):
        nki_kernels.reference_kernels()["bwd"](x, x, x, x, x, lse, use_causal_mask=True)


def test_reference_fwd_statistics_follow_the_documented_tiles():
    """attention_cte's cached softmax statistics: query g*128 + p at [..., p, g]; -max and 1/sum
    of the scaled causal scores, so -neg_max - log(recip) is the log-sum-exp."""
    n, s, d = 3, 256, 8  # cache_softmax needs S % 128 == 0
    q, k, v = jax.random.normal(jax.random.key(7), (3, n, s, d))
    out, neg_max, recip = nki_kernels.reference_kernels()["fwd"](
        q, k.transpose(0, 2, 1), v, scale=0.5, tp_q=True, tp_k=False, cache_softmax=True
    )
    scores = jnp.einsum("nqd,nkd->nqk", q, k) * 0.5
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    assert neg_max.shape == recip.shape == (n, 128, 2)
    got = (-neg_max - jnp.log(recip)).transpose(0, 2, 1).reshape(n, 256)[:, :s]
    np.testing.assert_allclose(got, lse, rtol=1e-5)
    np.testing.assert_allclose(out, jax.nn.softmax(scores, axis=-1) @ v, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sharded_reference():
    args = _inputs(b=4, s=16, seed=4)
    return args, _out_and_grads(functools.partial(blockwise_attention, block_size=8), *args)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_neuron_flash_dispatch_shards_over_mesh(sharded_reference, axis_type):
    """attention(impl="neuron_flash", mesh=...) runs the kernels per device (batch over
    data x fsdp, heads over model), equal to blockwise on the whole arrays; `substitute` is how
    the dry-run and neuron-check run it off-Neuron."""
    axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types)
    (q, k, v, ct), want = sharded_reference
    fn = functools.partial(attention, impl="neuron_flash", mesh=mesh)
    with nki_kernels.substitute(nki_kernels.reference_kernels()) as kernels:
        _assert_close(_out_and_grads(fn, q, k, v, ct), want)
    assert kernels["fwd"].grids == [2] and kernels["bwd"].grids == [2]  # the default LNC


def test_neuron_flash_without_sdk_is_one_line_error():
    q, k, v, _ = _inputs()
    try:
        nki_kernels.load_nki_attention_kernels()
    except ValueError:
        pass
    else:  # a Neuron machine: the kernels import, the error path does not apply
        return
    with pytest.raises(ValueError, match=r"NKI Library.*attention='blockwise'") as err:
        attention(q, k, v, impl="neuron_flash")
    assert "\n" not in str(err.value)


def test_argument_errors():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="kv_mask"):
        attention(q, k, v, impl="neuron_flash", kv_mask=jnp.ones((B, S), bool))
    with pytest.raises(ValueError, match="not one of"):
        attention(q, k, v, impl="flash2")
    for impl in ("blockwise", "flash"):
        with pytest.raises(ValueError, match="block_size=0"):
            attention(q, k, v, impl=impl, block_size=0)
    with pytest.raises(ValueError, match="chunk=-1"):
        flash_attention(q, k, v, chunk=-1)
    with pytest.raises(ValueError, match="not a multiple"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))


def test_forward_stand_in_rejects_what_the_kernel_rejects():
    fwd = nki_kernels.reference_kernels()["fwd"]
    x = jnp.zeros((1, 200, 8), jnp.float32)
    with pytest.raises(AssertionError, match="cache_softmax: S 200 % 128"):
        fwd(x, x, x, causal_mask=True, tp_q=True, tp_k=True, cache_softmax=True)
    big = jnp.zeros((513, 128, 8), jnp.float32)
    with pytest.raises(AssertionError, match="bs 513 > 512"):
        fwd(big, big, big, causal_mask=True, tp_q=True, tp_k=True, cache_softmax=True)


def test_backward_stand_in_rejects_mixed_dtypes():
    x = jnp.zeros((1, 1, 8, 128), jnp.float32)
    lse = jnp.zeros((1, 1, 128, 1), jnp.float32)
    bf = x.astype(jnp.bfloat16)
    with pytest.raises(AssertionError, match="must share a dtype"):
        nki_kernels.reference_kernels()["bwd"](x, x, x, x, bf, lse, use_causal_mask=True)


def test_stand_ins_take_the_kernels_parameters_in_the_kernels_order():
    """A positional call means what it means to the kernel (attention_cte.py:169,
    attention_bwd.py:44 in aws-neuron/nki-library 2.29, plus the 2.30+ trailing parameters):
    bound_min/bound_max sit between sinks_ref and use_causal_mask in the backward, k_prior...
    between causal_mask and tp_q; transpose_dv, cp_offset close the backward's list."""
    import inspect

    stand_ins = nki_kernels.reference_kernels()
    for key, want in (("fwd", nki_kernels.CTE_PARAMS), ("bwd", nki_kernels.BWD_PARAMS)):
        params = inspect.signature(stand_ins[key].fn).parameters.values()
        assert tuple(p.name for p in params) == want
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)  # no **kwargs: strict
    assert nki_kernels.BWD_PARAMS[6:10] == (
        "sinks_ref",
        "bound_min",
        "bound_max",
        "use_causal_mask",
    )
    assert nki_kernels.BWD_PARAMS[-2:] == ("transpose_dv", "cp_offset")
    assert nki_kernels.CTE_PARAMS[-2:] == ("cp_striped_input", "skip_output_normalization")


def test_backward_stand_in_positional_call_and_unknown_keywords():
    bwd = nki_kernels.reference_kernels()["bwd"]
    x = jnp.ones((1, 1, 8, 128), jnp.float32)
    lse = jnp.zeros((1, 1, 128, 1), jnp.float32)
    # the kernel's positional order: sinks_ref, bound_min, bound_max, use_causal_mask
    dq, dk, dv = bwd(x, x, x, x, x, lse, None, None, None, True)
    assert dq.shape == dk.shape == dv.shape == x.shape
    with pytest.raises(AssertionError, match="stand-in: causal"):  # 7th positional: not causal
        bwd(x, x, x, x, x, lse, None, None, None, False)
    with pytest.raises(AssertionError, match="both or neither"):  # the kernel's rule
        bwd(x, x, x, x, x, lse, None, jnp.zeros((128,)), None, True)
    with pytest.raises(TypeError):  # a misspelt keyword fails as it would on the kernel
        bwd(x, x, x, x, x, lse, use_casual_mask=True)


def test_forward_stand_in_positional_order_and_unknown_keywords():
    fwd = nki_kernels.reference_kernels()["fwd"]
    x = jnp.ones((2, 128, 8), jnp.float32)
    out = fwd(x, x, x, 1.0, True, None, None, None, None, None, True, True)  # tp_q, tp_k 11th/12th
    assert out.shape == x.shape
    with pytest.raises(AssertionError, match="no optional inputs"):  # 6th positional: k_prior
        fwd(x, x, x, 1.0, True, x)
    with pytest.raises(TypeError):
        fwd(x, x, x, cache_sofmax=True)
    with pytest.raises(AssertionError, match="head dim > 128"):
        wide = jnp.ones((1, 128, 129), jnp.float32)
        fwd(wide, wide, wide, tp_q=True, tp_k=True)


# ----------------------------------------------------------------------------------------------
# attention_bwd 2.30+: transpose_dv, cp_offset, and the checks that come with them
# ----------------------------------------------------------------------------------------------


def _bwd_inputs(s=256, h=2, kv=1, d=8, seed=11):
    """Kernel-layout q, k, v, o, dy (B=1) and the forward stand-in's lse, over S = s."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q, dy = (jax.random.normal(kk, (1, h, d, s)) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (1, kv, d, s)) for kk in ks[2:])

    def fold(x):  # (1, N, d, S) -> (N, S, d)
        return x.transpose(0, 1, 3, 2).reshape(-1, s, d)

    fwd = nki_kernels.reference_kernels()["fwd"]
    kw = dict(scale=d**-0.5, tp_q=True, tp_k=True, cache_softmax=True)
    o, neg_max, recip = fwd(fold(q), fold(k), fold(v), **kw)
    lse = (-neg_max - jnp.log(recip)).reshape(1, h, 128, s // 128)
    return q, k, v, o.reshape(1, h, s, d).transpose(0, 1, 3, 2), dy, lse


def test_backward_stand_in_transpose_dv_gives_dv_in_bskd():
    """transpose_dv=True: dv [bs, seqlen_k, nheads_kv, d] instead of [bs, nheads_kv, d,
    seqlen_k] (the 2.30+ docstring), the same numbers; dq, dk unchanged."""
    bwd = nki_kernels.reference_kernels()["bwd"]
    args = _bwd_inputs(kv=2, h=4)
    plain = bwd(*args, use_causal_mask=True, mixed_precision=True)
    moved = bwd(*args, use_causal_mask=True, mixed_precision=True, transpose_dv=True)
    assert moved[2].shape == (1, 256, 2, 8)
    np.testing.assert_array_equal(moved[2], plain[2].transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(moved[0], plain[0])
    np.testing.assert_array_equal(moved[1], plain[1])


def test_backward_stand_in_cp_offset_shifts_the_causal_mask():
    """A context-parallel query chunk: the last 128 queries of S=256, cp_offset=128, against all
    256 keys (seqlen_q != seqlen_k is allowed once cp_offset > 0). Query i sees key j when
    i + 128 >= j, so its dq equals the full call's dq for those queries, and its dk, dv equal
    the full call's with the first 128 queries' dy zeroed."""
    bwd = nki_kernels.reference_kernels()["bwd"]
    q, k, v, o, dy, lse = _bwd_inputs()
    dy_late = dy.at[..., :128].set(0.0)
    full = bwd(q, k, v, o, dy_late, lse, use_causal_mask=True, mixed_precision=True)
    late = (q[..., 128:], k, v, o[..., 128:], dy[..., 128:], lse[..., 1:])
    chunk = bwd(*late, use_causal_mask=True, mixed_precision=True, cp_offset=128)
    np.testing.assert_allclose(chunk[0], full[0][..., 128:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunk[1], full[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunk[2], full[2], rtol=1e-5, atol=1e-6)
    no_shift = bwd(*late, use_causal_mask=True, mixed_precision=True, cp_offset=1)
    assert float(jnp.max(jnp.abs(no_shift[2] - full[2]))) > 1e-2  # the offset matters


def test_backward_stand_in_refuses_causal_unequal_lengths_without_cp_offset():
    bwd = nki_kernels.reference_kernels()["bwd"]
    q, k, v, o, dy, lse = _bwd_inputs()
    with pytest.raises(AssertionError, match=r"seqlen_q 128 != seqlen_k 256 needs cp_offset > 0"):
        bwd(q[..., :128], k, v, o[..., :128], dy[..., :128], lse[..., :1], use_causal_mask=True)


def test_adapter_asks_the_backward_for_dv_transposed():
    """The launch passes transpose_dv=True and leaves cp_offset at 0; the gradients still equal
    plain attention (a dv in the untransposed layout would not fit the custom VJP)."""
    from trn_accum.model.attention import plain_attention

    ref = nki_kernels.reference_kernels()
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return ref["bwd"].fn(*args, **kwargs)

    bwd = nki_kernels.Launchable(recording, "recording")
    q, k, v, ct = _inputs(s=40, seed=9)
    fn = functools.partial(nki_flash_attention, fwd=ref["fwd"], bwd=bwd, lnc=1)
    _assert_close(_out_and_grads(fn, q, k, v, ct), _out_and_grads(plain_attention, q, k, v, ct))
    assert seen[0]["transpose_dv"] is True and "cp_offset" not in seen[0]


# ----------------------------------------------------------------------------------------------
# benchmarks/attention.py at a toy size
# ----------------------------------------------------------------------------------------------


def _benchmark_script():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_benchmark_runs_every_row_and_prices_it(capsys):
    """One table row per implementation asked for (no Pallas off a TPU); share of peak = the
    trainer's causal attention FLOPs (6 H Dh S^2 per sequence) / time / tpu-v5e's 197e12, and
    FlashAttention's benchmark count beside it (7 H Dh S^2)."""
    bench = _benchmark_script()
    argv = ["--seq", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--runs", "1"]
    rows = bench.main(argv + ["--blockwise", "8", "--flash", "8", "8:16", "--pallas", "8"])
    assert [r["name"] for r in rows] == ["blockwise 8", "flash 8", "flash 8:16", "xla"]
    flops = 6 * 4 * 8 * 32 * 32
    assert bench.attention_flops(1, 32, 4, 8) == flops
    for r in rows:
        assert r["ms"] > 0 and r["share"] == pytest.approx(flops / (r["ms"] / 1e3) / 197e12)
        assert r["fa2"] == pytest.approx(7 * 4 * 8 * 32 * 32 / (r["ms"] / 1e3) / 197e12)
    assert "flash 8:16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.parse_args(["--flash", "8:x"])


def test_attention_benchmark_counters_price_the_programs_without_running_them(capsys):
    """--counters: per row the model's counters of its fwd + bwd program, from shapes alone.
    With every dimension a multiple of the 128 tile, blockwise and flash do the same dot work:
    two dots per causal block pair forward, five backward (a pair scan: 10 pairs of 4 blocks
    of 128, forward and backward, 2 x 128^3 FLOPs each); the scan loops, flash does not."""
    bench = _benchmark_script()
    argv = ["--seq", "512", "--heads", "1", "--kv-heads", "1", "--head-dim", "128", "--counters"]
    rows = bench.main(argv + ["--blockwise", "128", "--flash", "128", "--no-xla"])
    by = {r["name"]: r for r in rows}
    assert set(by) == {"blockwise 128", "flash 128"}
    assert by["blockwise 128"]["loop_iterations"] == 2 * 10
    assert by["flash 128"]["loop_iterations"] == 0
    assert by["flash 128"]["dot_flops"] == by["blockwise 128"]["dot_flops"] == 7 * 10 * 2 * 128**3
    assert all(r["bytes"] > 0 and r["live_bytes"] > 0 for r in rows)
    # the model's price: the dots at no more than the chip's peak, plus the rest of the work
    assert all(r["priced_s"] > r["dot_flops"] / 197e12 for r in rows)
    assert "kernel+elementwise bytes" in capsys.readouterr().out


@pytest.mark.parametrize("impl", ["blockwise", "flash"])
def test_save_attention_keeps_the_residuals_so_no_forward_runs_twice(impl):
    """A Fuji layer under remat save_attention saves the attention's output and log-sum-exp
    (`RESIDUAL_NAMES`); under save_qkvo its gradient does exactly the attention's forward dots
    once more (two per causal block pair: 10 pairs of 4 blocks of 128, 2 heads of 128, batch
    1, 2 x 128^3 each), the price of keeping less."""
    from trn_accum.analysis import pricing
    from trn_accum.analysis.hlo.module import parse_hlo
    from trn_accum.model import fuji

    widths = dict(vocab_size=256, hidden_dim=256, num_heads=2, num_kv_heads=2, head_dim=128)
    base = fuji.ModelConfig(
        **widths,
        num_layers=1,
        ffn_dim=256,
        max_seq_len=512,
        layer_loop="unroll",
        compute_dtype="float32",
        attention=impl,
        attention_block=128,
    )
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 512), jnp.float32)
    batch = {"input_ids": ids, "target_labels": ids, "target_mask": mask}

    def dot_flops(remat):
        cfg = dataclasses.replace(base, remat=remat)
        params = jax.eval_shape(lambda: fuji.init_params(cfg, jax.random.key(0)))
        grad = jax.jit(jax.grad(lambda p, b: fuji.loss_fn(p, b, cfg)[0]))
        text = grad.lower(params, batch).as_text("hlo")
        return pricing.op_features(parse_hlo(text))["dot_flops"]

    assert set(attn_lib.RESIDUAL_NAMES) == {"attention_out", "attention_lse"}
    assert dot_flops("save_qkvo") - dot_flops("save_attention") == 2 * 10 * 2 * 128**3 * 2
