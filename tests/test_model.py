"""Fuji model: parameter counts, causality, GQA, RoPE, layer loops, remat, losses, shardings."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.config.load import SHARDING_RULE_SETS, ModelConfig, load_config
from trn_accum.model import fuji, sharding
from trn_accum.model.attention import attention

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "configs" / "fuji-3b-trn2.toml"
TINY = ROOT / "configs" / "fuji-tiny.toml"

# Small enough to compile in about a second; float32 so that comparisons can be tight.
SMALL = ModelConfig(
    vocab_size=128,
    num_layers=2,
    hidden_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    rope_theta=10000.0,
    max_seq_len=32,
    init="normal",
    init_std=0.1,  # larger than the default so that every path visibly moves the logits
    compute_dtype="float32",
    layer_loop="scan",
    remat="none",
)
B, S = 2, 16


# Compile-time matters on a shared 2-core machine: jit everything once, and initialise with an
# rbg key (partitionable threefry costs about 1 s of XLA:CPU compile per parameter shape).
_init = jax.jit(fuji.init_params, static_argnums=0)
_forward = jax.jit(fuji.forward, static_argnums=2)
_loss = jax.jit(fuji.loss_fn, static_argnums=2)
_value_and_grad = jax.jit(jax.value_and_grad(fuji.loss_fn, has_aux=True), static_argnums=2)


def _key(seed=0):
    return jax.random.key(seed, impl="rbg")


@pytest.fixture(scope="module")
def params():
    return _init(SMALL, _key(0))


def _tokens(key=1, b=B, s=S, vocab=SMALL.vocab_size):
    return jax.random.randint(jax.random.key(key), (b, s), 0, vocab, dtype=jnp.int32)


def _batch(tokens, mask=None):
    mask = jnp.ones(tokens.shape, jnp.float32) if mask is None else mask
    return {"input_ids": tokens, "target_labels": jnp.roll(tokens, -1, 1), "target_mask": mask}


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("vocab,expected", [(131072, 3_221_400_576), (128256, 3_212_749_824)])
def test_fuji_3b_parameter_count(vocab, expected):
    cfg = load_config(REF, [f"model.vocab_size={vocab}"]).model
    shapes = jax.eval_shape(fuji.init_params, cfg, jax.random.key(0))
    assert _count(shapes) == expected == fuji.num_params(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))
    # Tied LM head: the only parameter with a vocabulary dimension is the embedding.
    with_vocab = [p for p, x in jax.tree_util.tree_leaves_with_path(shapes) if vocab in x.shape]
    assert [jax.tree_util.keystr(p) for p in with_vocab] == ["['embed']"]
    assert jax.tree.structure(shapes) == jax.tree.structure(fuji.param_shapes(cfg))


def test_param_axes_cover_every_dimension():
    cfg = load_config(REF).model
    shapes, axes = fuji.param_shapes(cfg), fuji.param_axes(cfg)
    leaves = jax.tree.leaves(axes, is_leaf=lambda a: isinstance(a, tuple))
    assert len(leaves) == len(jax.tree.leaves(shapes))
    for s, a in zip(jax.tree.leaves(shapes), leaves, strict=True):
        assert len(a) == len(s.shape) and set(a) <= set(fuji.LOGICAL_AXES)
    assert set(fuji.RULES) == set(SHARDING_RULE_SETS)


def test_init_is_deterministic_with_the_configured_scale(params):
    again = _init(SMALL, _key(0))
    leaves, again = jax.tree.leaves(params), jax.tree.leaves(again)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, again, strict=True))
    np.testing.assert_allclose(np.std(params["layers"]["gate"]), SMALL.init_std, rtol=0.05)
    assert not np.array_equal(params["layers"]["gate"][0], params["layers"]["gate"][1])
    assert np.all(params["layers"]["attn_norm"] == 1) and np.all(params["final_norm"] == 1)


# --------------------------------------------------------------------------- behaviour


def test_causality_no_logit_depends_on_a_later_token(params):
    tokens = _tokens()
    t = 9
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % SMALL.vocab_size)
    a, b = _forward(params, tokens, SMALL), _forward(params, changed, SMALL)
    assert a.shape == (B, S, SMALL.vocab_size) and a.dtype == jnp.float32
    np.testing.assert_allclose(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert np.all(np.abs(a[:, t:] - b[:, t:]).max(axis=-1) > 1e-4)  # later positions do move


def test_gqa_model_equals_mha_with_repeated_kv_heads(params):
    """A GQA model equals the multi-head model whose KV projections repeat each KV head for its
    group of query heads (query head h reads KV head h // group)."""
    group = SMALL.num_heads // SMALL.num_kv_heads
    mha_cfg = dataclasses.replace(SMALL, num_kv_heads=SMALL.num_heads)
    mha = jax.tree.map(lambda x: x, params)
    for name in ("k", "v"):
        mha["layers"][name] = jnp.repeat(params["layers"][name], group, axis=2)
    tokens = _tokens()
    gqa_logits = _forward(params, tokens, SMALL)
    mha_logits = _forward(mha, tokens, mha_cfg)
    np.testing.assert_allclose(gqa_logits, mha_logits, rtol=1e-5, atol=1e-5)


def test_gqa_attention_equals_independent_mha_reference():
    b, s, h, kv, d = 2, 8, 6, 2, 4
    q, k, v = (
        jax.random.normal(jax.random.key(i), (b, s, n, d), jnp.float32)
        for i, n in ((0, h), (1, kv), (2, kv))
    )
    k_rep = np.repeat(np.asarray(k, np.float64), h // kv, axis=2)
    v_rep = np.repeat(np.asarray(v, np.float64), h // kv, axis=2)
    scores = np.einsum("bshd,bthd->bhst", np.asarray(q, np.float64), k_rep) / math.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("bhst,bthd->bshd", probs, v_rep)
    out = jax.jit(attention)(q, k, v)  # impl="plain"
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", fuji.ROPE_STYLES)
def test_rope_scores_depend_only_on_relative_position(style):
    d = 16
    q = jax.random.normal(jax.random.key(0), (d,), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (d,), jnp.float32)
    pos = jnp.arange(40)

    @jax.jit
    def rotated(x):  # x at every position: [1, 40, 1, d]
        return fuji.apply_rope(jnp.broadcast_to(x, (1, 40, 1, d)), pos, 10000.0, style)[0, :, 0]

    rq, rk = rotated(q), rotated(k)
    scores = np.asarray(rq @ rk.T)  # scores[m, n] = <rope(q, m), rope(k, n)>
    for offset in (0, 1, 7, 20):
        for m, n in ((3, 1), (10, 10), (2, 9), (0, 12)):
            np.testing.assert_allclose(
                scores[m + offset, n + offset], scores[m, n], rtol=1e-4, atol=1e-4
            )
    assert abs(scores[5, 1] - scores[5, 4]) > 1e-2  # it does depend on the distance
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)
    np.testing.assert_allclose(rq[0], q, rtol=1e-6)  # position 0: identity


def test_rope_interleaved_is_halves_on_interleaved_pairs():
    """AXLearn's interleaved pairs (2i, 2i+1) are the halves pairs (i, i + d/2) after moving
    even entries to the first half and odd ones to the second: the same rotation per pair."""
    d = 8
    x = jax.random.normal(jax.random.key(2), (1, 5, 3, d), jnp.float32)
    pos = jnp.arange(5)
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # interleaved -> halves
    inter = fuji.apply_rope(x, pos, 100.0, "interleaved")
    halves = fuji.apply_rope(x[..., perm], pos, 100.0, "halves")
    np.testing.assert_allclose(inter[..., perm], halves, rtol=1e-6, atol=1e-6)
    assert not np.allclose(inter, fuji.apply_rope(x, pos, 100.0, "halves"), atol=1e-3)
    angle = 1.0 * 100.0 ** (-0.0)  # position 1, pair 0: entries 0 and 1 rotate by 1 radian
    c, s_ = np.cos(angle), np.sin(angle)
    want = [x[0, 1, 0, 0] * c - x[0, 1, 0, 1] * s_, x[0, 1, 0, 1] * c + x[0, 1, 0, 0] * s_]
    np.testing.assert_allclose(inter[0, 1, 0, :2], want, rtol=1e-6)


def test_3b_init_std_per_parameter_follows_the_golden_rule():
    """The 3B config's init (AXLearn's golden init for fuji-3B-v3): normal(0, 1/fan_in) for
    every projection, with fan_in read here from the shapes (q/k/v/gate/up: their input dim;
    o: heads x head_dim; down: the FFN dim), and the embedding by its fan-out (hidden)."""
    from trn_accum.config.load import load_config

    cfg = load_config(ROOT / "configs" / "fuji-3b-trn2.toml").model
    assert cfg.init == "fan_in" and cfg.rope == "interleaved"
    shapes = jax.eval_shape(fuji.init_params, cfg, jax.random.key(0))
    stds = fuji.param_init_stds(cfg)
    lay = shapes["layers"]
    want = {
        "embed": 1 / np.sqrt(shapes["embed"].shape[1]),  # [V, D]: fan-out D
        "q": 1 / np.sqrt(lay["q"].shape[1]),  # [L, D, H, Dh]
        "k": 1 / np.sqrt(lay["k"].shape[1]),
        "v": 1 / np.sqrt(lay["v"].shape[1]),
        "o": 1 / np.sqrt(lay["o"].shape[1] * lay["o"].shape[2]),  # [L, H, Dh, D]
        "gate": 1 / np.sqrt(lay["gate"].shape[1]),  # [L, D, F]
        "up": 1 / np.sqrt(lay["up"].shape[1]),
        "down": 1 / np.sqrt(lay["down"].shape[1]),  # [L, F, D]
    }
    got = {"embed": stds["embed"], **{k: stds["layers"][k] for k in want if k != "embed"}}
    np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], rtol=1e-12)
    np.testing.assert_allclose(want["q"], 3072**-0.5) and np.testing.assert_allclose(
        want["down"], 8192**-0.5
    )
    assert stds["final_norm"] is None and stds["layers"]["attn_norm"] is None


def test_fan_in_init_draws_with_those_stds():
    cfg = dataclasses.replace(SMALL, init="fan_in", hidden_dim=64, ffn_dim=256, vocab_size=512)
    params = _init(cfg, _key(3))
    stds = fuji.param_init_stds(cfg)
    for name in ("q", "o", "down"):
        np.testing.assert_allclose(np.std(params["layers"][name]), stds["layers"][name], rtol=0.05)
    np.testing.assert_allclose(np.std(params["embed"]), 64**-0.5, rtol=0.05)


def test_layer_loops_and_remat_policies_agree(params):
    """scan vs unroll: same logits and gradients; every remat policy: same gradients."""
    tokens = _tokens()
    batch = _batch(tokens)
    variants = [("scan", "none"), ("unroll", "none"), ("scan", "full"), ("unroll", "save_qkvo")]
    cfgs = [dataclasses.replace(SMALL, layer_loop=lp, remat=r) for lp, r in variants]

    @jax.jit  # one compile for all variants
    def run(p, b):
        logits = [fuji.forward(p, b["input_ids"], c) for c in cfgs[:2]]
        return logits, [jax.value_and_grad(fuji.loss_fn, has_aux=True)(p, b, c) for c in cfgs]

    (scan_logits, unroll_logits), results = run(params, batch)
    np.testing.assert_allclose(unroll_logits, scan_logits, rtol=1e-5, atol=1e-6)
    (ref_loss, _), ref_grads = results[0]
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(ref_grads))
    for (loop, remat), ((loss, _), grads) in zip(variants[1:], results[1:], strict=True):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=f"{loop}/{remat}")


def test_remat_policies_save_what_they_say(params, capsys):
    """save_qkvo keeps the named projections and the context, and no attention scores; full
    keeps none of them."""
    cfg = dataclasses.replace(SMALL, num_layers=1, layer_loop="unroll")
    params = dict(params, layers=jax.tree.map(lambda x: x[:1], params["layers"]))
    batch = _batch(_tokens())
    saved = {}
    for remat in ("full", "save_qkvo"):
        c = dataclasses.replace(cfg, remat=remat)
        jax.ad_checkpoint.print_saved_residuals(lambda p, c=c: fuji.loss_fn(p, batch, c)[0], params)
        saved[remat] = capsys.readouterr().out

    # jax 0.10.1+ prints a checkpoint_name'd residual as "named 'q_proj'"; jax 0.10.0 as the
    # reduce_precision op that checkpoint_name lowers to (at the line of the _block call).
    def named(text):
        return sorted(
            line.split()[0]
            for line in text.splitlines()
            if "named '" in line or ("reduce_precision" in line and "(_block)" in line)
        )

    q, kv, o = "f32[2,16,4,8]", "f32[2,16,2,8]", "f32[2,16,32]"
    assert named(saved["save_qkvo"]) == sorted([q, kv, kv, q, o]), saved["save_qkvo"]
    if "named '" in saved["save_qkvo"]:
        assert all(f"named '{n}'" in saved["save_qkvo"] for n in fuji.REMAT_SAVED_NAMES)
    assert named(saved["full"]) == [], saved["full"]
    for text in saved.values():
        assert "attention.py" not in text and "[2,2,2,16,16]" not in text


def test_tiny_config_initial_loss_is_ln_vocab():
    cfg = load_config(TINY).model  # bfloat16 compute, scan, reference remat: as configured
    params = _init(cfg, _key(0))
    tokens = _tokens(key=5, b=8, s=64, vocab=cfg.vocab_size)
    loss, aux = _loss(params, _batch(tokens), cfg)
    assert abs(float(loss) - math.log(cfg.vocab_size)) < 0.1, float(loss)
    assert float(aux["num_target_tokens"]) == 8 * 64


def test_loss_masks_weights_and_empty_rows(params):
    tokens = _tokens()
    mask = np.ones((B, S), np.float32)
    mask[0, 5:] = 0  # row 0: 5 targets
    mask[1] = 0  # row 1: none
    batch = _batch(tokens, jnp.asarray(mask))
    batch["target_labels"] = jnp.where(mask > 0, batch["target_labels"], -100)  # ignored labels

    @jax.jit  # one compile
    def run(p, b):
        bool_mask = dict(b, target_mask=b["target_mask"] > 0)
        empty = dict(b, target_mask=jnp.zeros_like(b["target_mask"]))
        return (
            fuji.loss_fn(p, b, SMALL),
            fuji.loss_fn(p, bool_mask, SMALL)[0],
            jax.value_and_grad(fuji.loss_fn, has_aux=True)(p, empty, SMALL),
            fuji.forward(p, b["input_ids"], SMALL),
        )

    (loss, aux), bool_loss, ((loss0, aux0), grads0), logits = run(params, batch)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(jnp.roll(tokens, -1, 1))[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, nll[0, :5].mean(), rtol=1e-5)
    np.testing.assert_allclose(aux["per_example_loss"], [nll[0, :5].mean(), 0.0], rtol=1e-5)
    assert float(aux["num_target_tokens"]) == 5.0
    np.testing.assert_allclose(bool_loss, loss, rtol=1e-6)
    # no targets at all: loss 0, zero (finite) gradients
    assert float(loss0) == 0.0 and float(aux0["num_target_tokens"]) == 0.0
    assert np.all(np.asarray(aux0["per_example_loss"]) == 0)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads0))


# --------------------------------------------------------------------------- sharding


def _constraint_specs(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "sharding_constraint":
                yield eqn.params["sharding"].spec
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jaxpr.jaxpr))


def _mesh(shape, names):
    devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def test_shard_activation_uses_present_auto_dividing_axes():
    x = jnp.zeros((8, 4, 6))
    dims = ("batch", None, "heads")
    assert _constraint_specs(lambda x: sharding.shard_activation(x, dims), x) == []  # no mesh
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "model"))
    with jax.set_mesh(mesh):
        assert _constraint_specs(lambda x: sharding.shard_activation(x, dims), x) == [
            P(("data", "fsdp"), None, "model")
        ]
        # a batch of 2 only divides over "data"; 3 heads do not divide over "model"
        small = jnp.zeros((2, 4, 3))
        assert _constraint_specs(lambda x: sharding.shard_activation(x, dims), small) == [
            P("data", None, None)
        ]
        # inside a shard_map manual over "data", only the remaining auto axes are named
        body = jax.shard_map(
            lambda x: sharding.shard_activation(x, dims),
            in_specs=P("data"),
            out_specs=P("data"),
            axis_names={"data"},
        )
        assert _constraint_specs(body, x) == [P("fsdp", None, "model")]


def test_sharded_model_matches_unsharded_also_under_a_manual_data_axis(params):
    """trn2 rules on a (data 2, fsdp 2, model 2) mesh: the forward equals the unsharded one, and
    loss gradients taken inside a shard_map manual over "data" (per-shard partial gradients,
    one weighted psum: how the reduce-once accumulation uses the model) equal the full batch's."""
    cfg = dataclasses.replace(SMALL, remat="save_qkvo")
    tokens = _tokens(b=8)
    batch = _batch(tokens)
    expected_logits = _forward(params, tokens, cfg)
    (_, _), expected_grads = _value_and_grad(params, batch, cfg)
    mesh = _mesh((2, 2, 2), ("data", "fsdp", "model"))

    def local_grads(p, b):
        p = jax.tree.map(lambda x: jax.lax.pcast(x, ("data",), to="varying"), p)
        (_, aux), g = jax.value_and_grad(fuji.loss_fn, has_aux=True)(p, b, cfg)
        n = aux["num_target_tokens"]
        return jax.tree.map(lambda x: jax.lax.psum(x * n, "data") / jax.lax.psum(n, "data"), g)

    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, fuji.param_shardings(cfg, mesh, "trn2"))
        specs = _constraint_specs(lambda p, t: fuji.forward(p, t, cfg), sharded, tokens)
        assert P(("data", "fsdp"), None, "model", None) in specs  # q/k/v/context: heads on model
        assert P(("data", "fsdp"), None, "model") in specs  # SwiGLU hidden on model
        logits = _forward(sharded, tokens, cfg)
        np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-6)
        grads = jax.jit(
            jax.shard_map(
                local_grads, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"}
            )
        )(sharded, batch)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_param_specs_rules_and_errors():
    tiny = load_config(TINY).model
    for path, spec in jax.tree_util.tree_leaves_with_path(fuji.param_specs(tiny, "fsdp")):
        name = jax.tree_util.keystr(path)
        assert ("fsdp" in spec) == ("norm" not in name), (name, spec)
    ref = load_config(REF).model
    specs = fuji.param_specs(ref, fuji.RULES["trn2"])
    assert specs["layers"]["q"] == P(None, "fsdp", "model", None)
    assert specs["layers"]["down"] == P(None, "model", "fsdp")
    assert specs["embed"] == P("model", "fsdp")
    with pytest.raises(ValueError, match=r"layers/k .*'kv_heads' = 8 .*\('model',\) \(size 16\)"):
        fuji.param_specs(ref, "trn2", {"data": 1, "fsdp": 4, "model": 16})
    with pytest.raises(ValueError, match="lacks"):
        fuji.param_specs(ref, "trn2", {"data": 4, "fsdp": 16})
    with pytest.raises(ValueError, match="unknown logical axes"):
        fuji.param_specs(ref, {"hidden": "fsdp"})
    with pytest.raises(ValueError, match="not one of"):
        fuji.param_specs(ref, "tp")


SPECS_64 = r"""
import json, math
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding
from trn_accum.config.load import load_config
from trn_accum.model import fuji

assert jax.device_count() == 64
cfg = load_config("configs/fuji-3b-trn2.toml").model
mesh = Mesh(np.array(jax.devices()).reshape(1, 16, 4), ("data", "fsdp", "model"))
specs = fuji.param_specs(cfg, "trn2", mesh.shape)  # raises if a spec does not divide
shapes = fuji.param_shapes(cfg)
out = {"params": {}, "bytes_per_device": 0}
for (path, spec), shape in zip(jax.tree_util.tree_leaves_with_path(specs), jax.tree.leaves(shapes)):
    local = NamedSharding(mesh, spec).shard_shape(shape.shape)
    divides = all(d % l == 0 for d, l in zip(shape.shape, local))
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    out["params"][name] = {"spec": str(spec), "replicated": local == shape.shape,
                           "divides": divides}
    out["bytes_per_device"] += math.prod(local) * 4
compiled = jax.jit(fuji.init_params, static_argnums=0,
                   out_shardings=fuji.param_shardings(cfg, mesh, "trn2")).lower(
    cfg, jax.random.key(0)).compile()
out["init_output_bytes"] = compiled.memory_analysis().output_size_in_bytes
print(json.dumps(out))
"""


def test_fuji_3b_specs_on_a_64_device_trn2_node():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(64)
    run = subprocess.run(
        [sys.executable, "-c", SPECS_64], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    params = out["params"]
    assert all(p["divides"] for p in params.values())
    replicated = sorted(n for n, p in params.items() if p["replicated"])
    assert replicated == ["final_norm", "layers/attn_norm", "layers/ffn_norm"]
    norms = 2 * 28 * 3072 + 3072
    expected = (3_221_400_576 - norms) * 4 // 64 + norms * 4  # matrices over all 64 devices
    assert out["bytes_per_device"] == expected == 202_027_008
    # exact per-device output of the sharded init (memory_analysis; plus the few bytes of tuple)
    assert 0 <= out["init_output_bytes"] - expected < 1024
    print(f"Fuji 3B float32 params per device (fsdp 16 x model 4): {expected} B")


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_fused_projections_equal_separate_ones(dtype, rtol):
    """The fused grouped QKV and gate/up projections (one input-gradient reduction each under
    tensor parallelism) against the previous program's separate einsums: outputs and the
    gradients of the input and of every weight, exact in float32, within bf16 rounding."""
    cfg = ModelConfig(hidden_dim=32, num_heads=6, num_kv_heads=2, head_dim=8, ffn_dim=48)
    keys = jax.random.split(jax.random.key(3), 7)
    d, h, kv, dh, f = 32, 6, 2, 8, 48
    layer = {
        "q": jax.random.normal(keys[0], (d, h, dh)),
        "k": jax.random.normal(keys[1], (d, kv, dh)),
        "v": jax.random.normal(keys[2], (d, kv, dh)),
        "gate": jax.random.normal(keys[3], (d, f)),
        "up": jax.random.normal(keys[4], (d, f)),
    }
    x = jax.random.normal(keys[5], (2, 5, d)).astype(dtype)
    cot = jax.random.normal(keys[6], (2, 5, (h + 2 * kv) * dh + 2 * f))

    def separate(x, layer):
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, layer[n].astype(dtype)) for n in "qkv")
        gate, up = (jnp.einsum("bsd,df->bsf", x, layer[n].astype(dtype)) for n in ("gate", "up"))
        return q, k, v, gate, up

    def fused(x, layer):
        return (*fuji._fused_qkv(x, layer, cfg), *fuji._fused_gate_up(x, layer))

    def scalar(fn):
        def loss(x, layer):
            outs = [o.reshape(2, 5, -1).astype(jnp.float32) for o in fn(x, layer)]
            return jnp.sum(jnp.concatenate(outs, axis=-1) * cot)

        return loss

    # jitted: one compile per program instead of one per op (eager took 40-50 s on 2 cores)
    for a, b in zip(jax.jit(fused)(x, layer), jax.jit(separate)(x, layer), strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=rtol, atol=rtol)
    ga = jax.jit(jax.grad(scalar(fused), argnums=(0, 1)))(x, layer)
    gb = jax.jit(jax.grad(scalar(separate), argnums=(0, 1)))(x, layer)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        scale = float(jnp.max(jnp.abs(np.float32(b))))
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=rtol, atol=rtol * scale)


def test_fused_outputs_and_rope_pairs_come_apart_by_a_split():
    """q/k/v, gate/up and RoPE's interleaved pairs are taken out of one tensor by a split, so
    each backward pass puts the parts' gradients together with one concatenate; slices would
    give one zero-padded full-size copy per part and their sum. The program as written (before
    any compiler's simplification) has no pad."""
    cfg = ModelConfig(hidden_dim=16, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=24)
    shapes = {"q": (16, 4, 8), "k": (16, 2, 8), "v": (16, 2, 8), "gate": (16, 24), "up": (16, 24)}
    keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
    layer = {n: jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys, strict=False)}
    x = jax.random.normal(keys[-1], (1, 6, 16))

    def loss(x, layer):
        q, k, v = fuji._fused_qkv(x, layer, cfg)
        q = fuji.apply_rope(q, jnp.arange(6), 100.0, "interleaved")
        gate, up = fuji._fused_gate_up(x, layer)
        return sum(jnp.sum(t * t) for t in (q, k, v, gate, up))

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, layer).as_text(dialect="hlo")
    ops = re.findall(r"[\]}] ([a-z][\w-]*)\(", text)  # `... = f32[2,3]{1,0} pad(...`
    assert "dot" in ops
    assert "pad" not in ops
    assert ops.count("concatenate") >= 3  # q/k/v, gate/up, the RoPE pairs


def test_fused_projections_reduce_four_times_a_layer_over_model():
    """Under tensor parallelism (model 2) the backward pass of one layer reduces activations
    over "model" 4 times (q/k/v input gradient, o, gate/up input gradient, down), 2 of them in
    the forward pass: the partitioned program's all-reduces over "model", counted per layer
    from two depths (bf16 reductions only: the float32 ones are the norms' and the loss's)."""
    from trn_accum.analysis.collectives import collectives, group_axes
    from trn_accum.analysis.hlo.module import parse_hlo
    from trn_accum.train import step as step_lib

    def count(layers):
        cfg = load_config("configs/fuji-tiny.toml", [
            "mesh.data=1", "mesh.fsdp=2", "mesh.model=2", "mesh.rules=trn2",
            "data.global_batch=4", "trainer.accum_steps=1", "model.layer_loop=unroll",
            f"model.num_layers={layers}", "model.remat=none"])  # fmt: skip
        mesh = step_lib.make_mesh(cfg, jax.devices()[:4])
        module = parse_hlo(step_lib.build_step(cfg, mesh).compiled.as_text())
        shape = dict(mesh.shape)
        return sum(
            c.kind == "all-reduce"
            and group_axes(c.replica_groups, shape) == ("model",)
            and c.wire_bytes_source < c.bytes  # a bf16 reduction widened by XLA:CPU
            for c in collectives(module)
        )

    assert count(3) - count(2) == 4
