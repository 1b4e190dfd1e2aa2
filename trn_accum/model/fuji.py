"""The Fuji decoder (AXLearn's LLaMA-style family) in plain JAX, readable top to bottom.

tokens int32 [B, S]
  -> embedding lookup (tied with the LM head)                       x [B, S, D]
  -> num_layers x pre-norm block:
       x += o(attention(rope(q(rms(x))), rope(k(rms(x))), v(rms(x))))  causal, grouped-query
       x += down(silu(gate(rms(x))) * up(rms(x)))                       SwiGLU
  -> final RMSNorm -> logits = x @ embedding.T (float32)             [B, S, V]

Parameters are float32; the computation runs in `cfg.compute_dtype` (norms, RoPE, softmax and
the log-sum-exp in float32). No biases, no dropout. Every `cfg` here is a
`trn_accum.config.ModelConfig`.

Parameter tree (stable: the trainer and checkpoints rely on it). Layer parameters are stacked on
a leading `layers` axis for both layer loops ("scan" scans over it, "unroll" slices it), so a
checkpoint does not depend on the loop:

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "q": [L, D, H, Dh], "k": [L, D, KV, Dh],
                "v": [L, D, KV, Dh], "o": [L, H, Dh, D], "ffn_norm": [L, D],
                "gate": [L, D, F], "up": [L, D, F], "down": [L, F, D]},
     "final_norm": [D]}

Sharding. `param_axes(cfg)` names the logical axis of every parameter dimension; a rule set
(`RULES["trn2"]`, `RULES["fsdp"]`, or any mapping logical axis -> mesh axis) turns them into
PartitionSpecs (`param_specs`). Activations are constrained inside the model only when a mesh is
active (`jax.set_mesh`): batch over the mesh's ("data", "fsdp") axes, heads and the FFN hidden
over "model" (see `shard_activation`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.core.constraints import constrain
from trn_accum.model.attention import IMPLS as ATTENTION_IMPLS
from trn_accum.model.attention import attention
from trn_accum.model.rope import ROPE_SCALINGS, ROPE_STYLES, apply_rope, inverse_frequencies
from trn_accum.model.xent import cross_entropy, lm_logits

COMPUTE_DTYPES = ("bfloat16", "float32")
LAYER_LOOPS = ("scan", "unroll")
REMAT_POLICIES = ("none", "full", "save_qkvo")
# "fan_in": std 1/sqrt(fan) per matrix, the reference's rule (AXLearn's golden init config for
# fuji-3B-v3, axlearn/experiments/testdata/.../fuji-3B-v3_init.txt: normal(0, 1/fan_in) for
# q/k/v/o/gate/up/down, the embedding normal(0, 1/fan_out)); "normal": std `init_std` for all.
INITS = ("fan_in", "normal")


def _choices(*allowed: str) -> dict:
    """Field metadata read by `trn_accum.train.config`: the allowed values of a string key."""
    return {"choices": allowed}


@dataclass(frozen=True)
class ModelConfig:
    """The `[model]` section: shapes and implementation choices of one Fuji model.

    Defaults: Fuji 3B v3 (AXLearn `fuji.py`, `get_trainer_kwargs` for model size "3B",
    version 3: 28 layers, hidden 3072, 24 heads of 128, 8 KV heads, FFN 8192, vocabulary
    131072, RoPE theta 500000, RMSNorm eps 1e-5, tied embedding).
    """

    vocab_size: int = 131072
    num_layers: int = 28
    hidden_dim: int = 3072
    num_heads: int = 24
    num_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    init: str = field(default="fan_in", metadata=_choices(*INITS))
    init_std: float = 0.02  # init = "normal": normal(0, init_std) for every matrix
    rope: str = field(default="interleaved", metadata=_choices(*ROPE_STYLES))  # model/rope.py
    rope_scaling: str = field(default="none", metadata=_choices(*ROPE_SCALINGS))  # "llama3"
    rope_scaling_factor: float = 32.0  # the llama3 scaling's factor, low/high_freq_factor and
    rope_low_freq_factor: float = 1.0  # original_max_position_embeddings (Llama 3.2's values)
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    compute_dtype: str = field(default="bfloat16", metadata=_choices(*COMPUTE_DTYPES))
    layer_loop: str = field(default="scan", metadata=_choices(*LAYER_LOOPS))
    # none | full | save_qkvo (reference: keep the q/k/v/o projections and attention context)
    remat: str = field(default="none", metadata=_choices(*REMAT_POLICIES))
    attention: str = field(default="plain", metadata=_choices(*ATTENTION_IMPLS))
    attention_block: int = 512  # block size of blockwise / flash attention
    loss_chunk: int = 0  # tokens per batch shard per LM-head/cross-entropy chunk; 0 = no chunking


# ---------------------------------------------------------------------------------------------
# Parameters: one table gives shapes, logical axes and initialisation of every parameter.

LOGICAL_AXES = ("vocab", "embed", "layers", "heads", "kv_heads", "head_dim", "ffn", "norm")

# Logical axis -> mesh axis (a name, a tuple of names, or None = replicated).
RULES: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    # The reference on trn2 (AXLearn `experiments/text/gpt/fuji.py`, its trn2 mesh rules):
    # every matrix sharded over fsdp on its model (embed) dimension and over "model" (tensor
    # parallel) on heads / FFN hidden / vocabulary.
    "trn2": {
        "vocab": "model",
        "embed": "fsdp",
        "heads": "model",
        "kv_heads": "model",
        "ffn": "model",
        "layers": None,
        "head_dim": None,
        "norm": None,
    },
    # Plain FSDP: every matrix sharded over fsdp on its model (embed) dimension.
    "fsdp": {
        "vocab": None,
        "embed": "fsdp",
        "heads": None,
        "kv_heads": None,
        "ffn": None,
        "layers": None,
        "head_dim": None,
        "norm": None,
    },
}

BATCH_AXES = ("data", "fsdp")
# Activation dimension kind -> mesh axes it is sharded over (those present, Auto and dividing).
_ACTIVATION_AXES = {
    "batch": BATCH_AXES,
    "seq": ("seq",),
    "heads": ("model",),
    "ffn": ("model",),
    "vocab": ("model",),
}

REMAT_SAVED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "context")

# A ModelConfig is a static pytree (no leaves, hashable): `jax.eval_shape(init_params, cfg, key)`
# and `jax.jit(loss_fn)(params, batch, cfg)` treat it as a compile-time constant.
jax.tree_util.register_static(ModelConfig)


@dataclasses.dataclass(frozen=True)
class _Param:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    fan: tuple[str, ...] = ()  # logical axes whose sizes multiply to the fan; () = norm scale 1


def _param_table(cfg: ModelConfig) -> dict:
    L, D, F, V = cfg.num_layers, cfg.hidden_dim, cfg.ffn_dim, cfg.vocab_size
    H, KV, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "embed": _Param((V, D), ("vocab", "embed"), ("embed",)),  # fan-out, as the reference
        "layers": {
            "attn_norm": _Param((L, D), ("layers", "norm")),
            "q": _Param((L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), ("embed",)),
            "k": _Param((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim"), ("embed",)),
            "v": _Param((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim"), ("embed",)),
            "o": _Param(
                (L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), ("heads", "head_dim")
            ),
            "ffn_norm": _Param((L, D), ("layers", "norm")),
            "gate": _Param((L, D, F), ("layers", "embed", "ffn"), ("embed",)),
            "up": _Param((L, D, F), ("layers", "embed", "ffn"), ("embed",)),
            "down": _Param((L, F, D), ("layers", "ffn", "embed"), ("ffn",)),
        },
        "final_norm": _Param((D,), ("norm",)),
    }


def _init_std(cfg: ModelConfig, p: _Param) -> float | None:
    if not p.fan:
        return None
    if cfg.init == "normal":
        return cfg.init_std
    fan = math.prod(n for n, a in zip(p.shape, p.axes, strict=True) if a in p.fan)
    return 1.0 / math.sqrt(fan)


def param_init_stds(cfg: ModelConfig) -> dict:
    """The initial std of every parameter (the parameter tree; None for the norm scales, which
    start at 1): `cfg.init` "fan_in" = 1/sqrt(fan) (q/k/v/gate/up: hidden; o: heads x
    head_dim; down: ffn; the embedding: its fan-out, hidden), "normal" = `cfg.init_std`."""
    return jax.tree.map(
        lambda p: _init_std(cfg, p),
        _param_table(cfg),
        is_leaf=lambda x: isinstance(x, _Param),
    )


def init_params(cfg: ModelConfig, key) -> dict:
    """float32 parameters (tree in the module docstring). Matrices ~ normal(0, std) with the std
    of `param_init_stds`, norm scales 1. Works under `jax.eval_shape` and under
    `jax.jit(..., out_shardings=...)`."""
    leaves, treedef = jax.tree.flatten(_param_table(cfg))
    keys = jax.random.split(key, len(leaves))
    arrays = [
        jnp.ones(p.shape, jnp.float32)
        if _init_std(cfg, p) is None
        else _init_std(cfg, p) * jax.random.normal(k, p.shape, jnp.float32)
        for p, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


def param_shapes(cfg: ModelConfig) -> dict:
    """Tree of `jax.ShapeDtypeStruct` (float32) matching `init_params`; no computation."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), _param_table(cfg))


def num_params(cfg: ModelConfig) -> int:
    """Exact parameter count (the LM head is the embedding: counted once)."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(_param_table(cfg)))


def param_axes(cfg: ModelConfig) -> dict:
    """Tree (same structure as the params) of tuples of logical axis names, one per dim."""
    return jax.tree.map(lambda p: p.axes, _param_table(cfg))


def param_specs(
    cfg: ModelConfig,
    rules: str | Mapping[str, str | tuple[str, ...] | None],
    mesh_shape: Mapping[str, int] | None = None,
) -> dict:
    """Tree of PartitionSpec for the params under `rules` (a name in RULES or a mapping
    logical axis -> mesh axis / tuple of mesh axes / None; a missing logical axis is replicated).

    With `mesh_shape` (e.g. `mesh.shape`), every sharded dimension must be divisible by the
    product of its mesh axes and those axes must exist: otherwise ValueError naming the
    parameter, the dimension and the axis.
    """
    if isinstance(rules, str):
        if rules not in RULES:
            raise ValueError(f"sharding rules {rules!r}: not one of {tuple(RULES)}")
        rules = RULES[rules]
    unknown = sorted(set(rules) - set(LOGICAL_AXES))
    if unknown:
        raise ValueError(
            f"sharding rules name unknown logical axes {unknown}; known: {LOGICAL_AXES}"
        )

    def spec(path, p: _Param) -> P:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        entries = [rules.get(ax) for ax in p.axes]
        used = [a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if len(used) != len(set(used)):
            raise ValueError(f"param {name}: rules map two of its axes {p.axes} to {entries}")
        if mesh_shape is not None:
            for dim, ax, entry in zip(p.shape, p.axes, entries, strict=True):
                axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
                for a in axes:
                    if a not in mesh_shape:
                        raise ValueError(
                            f"param {name}: rule {ax!r} -> {a!r} names a mesh axis that the mesh "
                            f"{dict(mesh_shape)} lacks; fix the rules or the mesh"
                        )
                n = math.prod(mesh_shape[a] for a in axes)
                if dim % n:
                    raise ValueError(
                        f"param {name} {p.shape}: dimension {ax!r} = {dim} is not divisible by "
                        f"mesh axes {axes} (size {n}); change the model size or the mesh"
                    )
        return P(*entries)

    return jax.tree_util.tree_map_with_path(spec, _param_table(cfg))


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules) -> dict:
    """Tree of NamedSharding on `mesh` (divisibility checked, see `param_specs`)."""
    specs = param_specs(cfg, rules, mesh.shape)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


# ---------------------------------------------------------------------------------------------
# Activation sharding


def shard_activation(x, dims: tuple[str | None, ...]):
    """Constrain activation `x` when a mesh is active (`jax.set_mesh`); otherwise return it.

    `dims` names each dimension: "batch" -> the mesh's ("data", "fsdp") axes, "seq" -> "seq",
    "heads" / "ffn" / "vocab" -> "model", None -> replicated. Only axes that exist in the current
    mesh, are Auto (not Manual inside a shard_map, not Explicit) and keep the dimension divisible
    are used, so the same model runs on any mesh and inside `shard_map(..., axis_names={"data"})`.
    The constraint itself is `trn_accum.core.constraints.constrain` on the ambient mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Auto}
    if not auto:
        return x
    entries = []
    for size, kind in zip(x.shape, dims, strict=True):
        chosen, n = [], 1
        for a in _ACTIVATION_AXES.get(kind, ()):
            if a in auto and size % (n * mesh.shape[a]) == 0:
                chosen.append(a)
                n *= mesh.shape[a]
        entries.append(tuple(chosen) if len(chosen) > 1 else chosen[0] if chosen else None)
    return constrain(x, mesh, P(*entries))


def batch_groups(size: int) -> int:
    """Shards of a "batch" dimension of `size` under the current mesh (1 without one): the
    product of the axes `shard_activation` would use for it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Auto}
    n = 1
    for a in _ACTIVATION_AXES["batch"]:
        if a in auto and size % (n * mesh.shape[a]) == 0:
            n *= mesh.shape[a]
    return n


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last dim, computed in float32, returned in x's dtype. scale [D] f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def _fused_qkv(h, layer, cfg: ModelConfig):
    """q [B, S, H, Dh], k and v [B, S, KV, Dh] from one grouped projection (AXLearn's
    `FusedGroupedQKVLinear`, the v3 configs' QKV layer): the weights are laid out per KV head
    as [D, KV, H / KV + 2, Dh] (the KV head's query heads, then its key, then its value), so a
    heads-sharded ("model") q and a kv-heads-sharded k / v concatenate without moving data, and
    the backward pass sums the three input-gradient partials in one einsum before the single
    tensor-parallel reduction (one instead of three per layer). Query head h uses KV head
    h // (H / KV), the grouping of `trn_accum.model.attention`. Same parameters and numbers as
    three separate projections."""
    b, s, d = h.shape
    kv, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kv
    w = jnp.concatenate(
        [layer["q"].reshape(d, kv, g, dh), layer["k"][:, :, None], layer["v"][:, :, None]], axis=2
    ).astype(h.dtype)
    qkv = jnp.einsum("bsd,dkgh->bskgh", h, w)  # [B, S, KV, G + 2, Dh]
    return qkv[:, :, :, :g].reshape(b, s, kv * g, dh), qkv[:, :, :, g], qkv[:, :, :, g + 1]


def _fused_gate_up(h, layer):
    """gate and up [B, S, F] from one [D, 2, F] projection (stacked on an unsharded axis, so no
    data moves): the backward pass sums the two input-gradient partials in the einsum, one
    tensor-parallel reduction instead of two. Same numbers as two projections."""
    w = jnp.stack([layer["gate"], layer["up"]], axis=1).astype(h.dtype)
    gate_up = jnp.einsum("bsd,dtf->bstf", h, w)
    return gate_up[:, :, 0], gate_up[:, :, 1]


def _block(x, layer, cfg: ModelConfig):
    """One pre-norm decoder block. x [B, S, D] (compute dtype); layer: one layer of params."""
    dt = x.dtype
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    rope = (positions, cfg.rope_theta, cfg.rope, inverse_frequencies(cfg))

    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q, k, v = _fused_qkv(h, layer, cfg)
    heads = ("batch", "seq", "heads", None)
    q = checkpoint_name(shard_activation(apply_rope(q, *rope), heads), "q_proj")
    k = checkpoint_name(shard_activation(apply_rope(k, *rope), heads), "k_proj")
    v = checkpoint_name(shard_activation(v, heads), "v_proj")
    ctx = attention(q, k, v, impl=cfg.attention, block_size=cfg.attention_block, kv_mask=None)
    ctx = checkpoint_name(shard_activation(ctx, heads), "context")
    o = checkpoint_name(jnp.einsum("bshk,hkd->bsd", ctx, layer["o"].astype(dt)), "o_proj")
    x = shard_activation(x + o, ("batch", "seq", None))

    h = rms_norm(x, layer["ffn_norm"], cfg.norm_eps)
    gate, up = _fused_gate_up(h, layer)
    act = shard_activation(jax.nn.silu(gate) * up, ("batch", "seq", "ffn"))
    x = x + jnp.einsum("bsf,fd->bsd", act, layer["down"].astype(dt))
    return shard_activation(x, ("batch", "seq", None))


def _remat(fn, policy: str, *, in_scan: bool):
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, prevent_cse=not in_scan)
    if policy == "save_qkvo":
        saved = jax.checkpoint_policies.save_only_these_names(*REMAT_SAVED_NAMES)
        return jax.checkpoint(fn, policy=saved, prevent_cse=not in_scan)
    raise ValueError(f"model.remat = {policy!r}: not one of {REMAT_POLICIES}")


def _unstack(tree, n: int) -> list:
    """[n, ...]-stacked tree -> list of n trees (one split per leaf: its gradient is a concat)."""
    parts = jax.tree.map(lambda a: [s[0] for s in jnp.split(a, n, axis=0)], tree)
    return [jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=lambda p: isinstance(p, list))
            for i in range(n)]  # fmt: skip


def hidden_states(params, tokens, cfg: ModelConfig):
    """Final-normed hidden states [B, S, D] in the compute dtype. tokens int32 [B, S]."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence {tokens.shape[1]} > model.max_seq_len {cfg.max_seq_len}")
    dt = jnp.dtype(cfg.compute_dtype)
    # Gather the table over its embed (fsdp) dimension first, in the compute dtype, as FSDP does
    # for every weight: a lookup into a table sharded on the embed dimension whose output is
    # batch-sharded over the same axis crashes XLA's partitioner inside a shard_map that is
    # manual over "data" (jax 0.10.2, spmd_partitioner_util.cc "Check failed").
    table = shard_activation(params["embed"].astype(dt), ("vocab", None))
    x = shard_activation(jnp.take(table, tokens, axis=0), ("batch", "seq", None))
    if cfg.layer_loop == "scan":
        block = _remat(functools.partial(_block, cfg=cfg), cfg.remat, in_scan=True)
        x, _ = jax.lax.scan(lambda c, layer: (block(c, layer), None), x, params["layers"])
    elif cfg.layer_loop == "unroll":
        block = _remat(functools.partial(_block, cfg=cfg), cfg.remat, in_scan=False)
        for layer in _unstack(params["layers"], cfg.num_layers):
            x = block(x, layer)
    else:
        raise ValueError(f"model.layer_loop = {cfg.layer_loop!r}: not one of {LAYER_LOOPS}")
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def forward(params, tokens, cfg: ModelConfig):
    """Logits float32 [B, S, V] for tokens int32 [B, S] (LM head tied to the embedding)."""
    return lm_logits(hidden_states(params, tokens, cfg), params["embed"])


def loss_fn(params, batch, cfg: ModelConfig):
    """Next-token cross-entropy, mean over target tokens whose mask is on.

    batch: {"input_ids": int32 [B, S], "target_labels": int32 [B, S],
            "target_mask": bool or float32 [B, S]} (a float mask weights tokens; 0 = off).
    Returns (loss float32 [], aux) with aux = {"per_example_loss": float32 [B] (0 for a row
    without targets), "num_target_tokens": float32 [] (the mask's sum)}. A batch without
    targets has loss 0 and zero gradients. Labels under a zero mask may be anything (e.g. -100).
    """
    mask = batch["target_mask"]
    on = mask != 0
    weight = mask.astype(jnp.float32)
    labels = jnp.where(on, batch["target_labels"], 0)
    hidden = hidden_states(params, batch["input_ids"], cfg)
    # loss_chunk counts tokens per batch shard: a chunk of the global minibatch is loss_chunk x
    # its shards, so the chunk loop runs (tokens per shard / loss_chunk) times on any mesh and
    # node count (one compile on 2 nodes then stands for 32; see trn_accum.analysis.steptime)
    shards = batch_groups(labels.shape[0])
    chunk = min(cfg.loss_chunk * shards, labels.size) if cfg.loss_chunk else None
    per_token = cross_entropy(
        hidden,
        params["embed"],
        labels,
        chunk=chunk,
        groups=batch_groups(chunk) if chunk else 1,
        shard=shard_activation,
    )
    per_token = jnp.where(on, per_token * weight, 0.0)
    row_sum, row_weight = per_token.sum(axis=-1), weight.sum(axis=-1)
    total, count = row_sum.sum(), row_weight.sum()
    per_example = jnp.where(row_weight > 0, row_sum / jnp.where(row_weight > 0, row_weight, 1), 0)
    loss = jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0.0)
    return loss, {"per_example_loss": per_example, "num_target_tokens": count}
