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

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from trn_accum.core import gather_once
from trn_accum.model.attention import IMPLS as ATTENTION_IMPLS
from trn_accum.model.attention import NAMES_RESIDUALS, attention
from trn_accum.model.attention import RESIDUAL_NAMES as ATTENTION_RESIDUALS
from trn_accum.model.params import (  # noqa: F401  (re-exported: the model's public names)
    LOGICAL_AXES,
    RULES,
    init_params,
    num_params,
    param_axes,
    param_init_stds,
    param_shapes,
    param_shardings,
    param_specs,
)
from trn_accum.model.rope import ROPE_SCALINGS, ROPE_STYLES, apply_rope, inverse_frequencies
from trn_accum.model.sharding import (
    activation_spec,
    batch_groups,
    layer_tie_specs,
    shard_activation,
)
from trn_accum.model.xent import cross_entropy, lm_logits

COMPUTE_DTYPES = ("bfloat16", "float32")
LAYER_LOOPS = ("scan", "unroll")
REMAT_POLICIES = ("none", "full", "save_qkvo", "save_attention")
AUTO = "auto"  # model.remat / attention / attention_block / loss_chunk: chosen before a build
_UNRESOLVED = (
    '{key} = "auto" is chosen before the step is built (trn_accum.plan.settings.choose, '
    "which `trn-accum train` and the dry-run call); set a value to build the model directly"
)
# "fan_in": std 1/sqrt(fan) per matrix, the reference's rule (AXLearn's golden init config for
# fuji-3B-v3, axlearn/experiments/testdata/.../fuji-3B-v3_init.txt: normal(0, 1/fan_in) for
# q/k/v/o/gate/up/down, the embedding normal(0, 1/fan_out)); "normal": std `init_std` for all.
INITS = ("fan_in", "normal")


def _choices(*allowed: str) -> dict:
    """Field metadata read by `trn_accum.config.load`: the allowed values of a string key."""
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
    # | save_attention (save_qkvo and the attention's output and log-sum-exp: no second forward)
    # "auto" (here, in attention, attention_block and loss_chunk): chosen by the settings search
    # before the step is built (trn_accum.plan.settings)
    remat: str = field(default="none", metadata=_choices(*REMAT_POLICIES, AUTO))
    attention: str = field(default="plain", metadata=_choices(*ATTENTION_IMPLS, AUTO))
    attention_block: int | str = 512  # block size of blockwise / flash attention
    loss_chunk: int | str = 0  # tokens per batch shard per LM-head/cross-entropy chunk; 0 = whole

    @property
    def names_attention_residuals(self) -> bool:
        """Whether the attention names its output and log-sum-exp for remat save_attention
        (blockwise, flash); otherwise save_attention saves what save_qkvo does."""
        return self.attention in NAMES_RESIDUALS


REMAT_SAVED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "context")
# What each saving policy keeps: save_attention adds the blockwise or flash attention's own
# residuals (output and float32 log-sum-exp), so that its backward runs no second forward.
_SAVED_BY_POLICY = {
    "save_qkvo": REMAT_SAVED_NAMES,
    "save_attention": (*REMAT_SAVED_NAMES, *ATTENTION_RESIDUALS),
}


def distinct_remat_policies(attention: str) -> tuple[str, ...]:
    """`REMAT_POLICIES` that make different programs with this attention: save_attention is
    save_qkvo where the attention names no residuals ("plain", "neuron_flash")."""
    if attention in NAMES_RESIDUALS:
        return REMAT_POLICIES
    return tuple(p for p in REMAT_POLICIES if p != "save_attention")


# A ModelConfig is a static pytree (no leaves, hashable): `jax.eval_shape(init_params, cfg, key)`
# and `jax.jit(loss_fn)(params, batch, cfg)` treat it as a compile-time constant.
jax.tree_util.register_static(ModelConfig)

# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last dim, computed in float32, returned in x's dtype. scale [D] f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def _weight(w, plan, dt, dims):
    """A weight in the compute dtype, whole: the (shard) cast, then all-gathered along `plan`'s
    dimensions (`trn_accum.model.fsdp`; () = already whole), manual over every mesh axis (split
    over the automatic ones as `dims` says). Inside a rematerialised layer the backward pass
    gathers it again instead of keeping it; its gradient is reduce-scattered in `dt`."""
    w = w.astype(dt)
    return gather_once.gather_manual(w, plan, activation_spec(w.shape, dims))


def _fused(ws, plans, dt, fuse, dims):
    """fuse([weights]) of the gathered weights: fused on the shards and gathered once (one
    collective, one reduce-scatter of the fused gradient) when their plans agree and gather
    only dimension 0 (which `fuse` keeps); otherwise each gathered, then fused."""
    if all(p == plans[0] for p in plans) and all(d == 0 for d, _ in plans[0]):
        return _weight(fuse(ws), plans[0], dt, dims)
    return fuse([_weight(w, p, dt, (None,) * w.ndim) for w, p in zip(ws, plans, strict=True)])


def _fused_qkv(h, layer, cfg: ModelConfig, plans=None):
    """q [B, S, H, Dh], k and v [B, S, KV, Dh] from one grouped projection (AXLearn's
    `FusedGroupedQKVLinear`, the v3 configs' QKV layer): the weights are laid out per KV head
    as [D, KV, H / KV + 2, Dh] (the KV head's query heads, then its key, then its value), so a
    heads-sharded ("model") q and a kv-heads-sharded k / v concatenate without moving data, and
    the backward pass sums the three input-gradient partials in one einsum before the single
    tensor-parallel reduction (one instead of three per layer). Query head h uses KV head
    h // (H / KV), the grouping of `trn_accum.model.attention`. Same parameters and numbers as
    three separate projections."""
    b, s, _ = h.shape
    kv, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kv

    def fuse(ws):
        q, k, v = ws
        return jnp.concatenate([q.reshape(q.shape[0], kv, g, dh), k[:, :, None], v[:, :, None]], 2)

    names, heads = ("q", "k", "v"), (None, "heads", None, None)
    w = _fused(
        [layer[n] for n in names], [(plans or {}).get(n, ()) for n in names], h.dtype, fuse, heads
    )
    qkv = jnp.einsum("bsd,dkgh->bskgh", h, w)  # [B, S, KV, G + 2, Dh]
    # one split, whose gradient is one concatenate (three slices' would be three pads and adds)
    q, k, v = jnp.split(qkv, [g, g + 1], axis=3)
    return q.reshape(b, s, kv * g, dh), k[:, :, :, 0], v[:, :, :, 0]


def _fused_gate_up(h, layer, plans=None):
    """gate and up [B, S, F] from one [D, 2, F] projection (stacked on an unsharded axis, so no
    data moves): the backward pass sums the two input-gradient partials in the einsum, one
    tensor-parallel reduction instead of two. Same numbers as two projections."""
    plans = plans or {}
    ws, ps = [layer["gate"], layer["up"]], [plans.get("gate", ()), plans.get("up", ())]
    w = _fused(ws, ps, h.dtype, lambda ws: jnp.stack(ws, axis=1), (None, None, "ffn"))
    gate, up = jnp.split(jnp.einsum("bsd,dtf->bstf", h, w), 2, axis=2)  # gradient: a concatenate
    return gate[:, :, 0], up[:, :, 0]


def _block(x, layer, cfg: ModelConfig, plans: dict):
    """One pre-norm decoder block. x [B, S, D] (compute dtype); layer: one layer of params
    (shards along `plans`: per matrix, the dimensions to gather; {} = whole)."""
    dt = x.dtype
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    rope = (positions, cfg.rope_theta, cfg.rope, inverse_frequencies(cfg))

    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q, k, v = _fused_qkv(h, layer, cfg, plans)
    heads = ("batch", "seq", "heads", None)
    q = checkpoint_name(shard_activation(apply_rope(q, *rope), heads), "q_proj")
    k = checkpoint_name(shard_activation(apply_rope(k, *rope), heads), "k_proj")
    v = checkpoint_name(shard_activation(v, heads), "v_proj")
    for key in ("attention", "attention_block"):
        if getattr(cfg, key) == AUTO:
            raise ValueError(_UNRESOLVED.format(key=f"model.{key}"))
    ctx = attention(q, k, v, impl=cfg.attention, block_size=cfg.attention_block, kv_mask=None)
    ctx = checkpoint_name(shard_activation(ctx, heads), "context")
    o = checkpoint_name(
        jnp.einsum(
            "bshk,hkd->bsd", ctx, _weight(layer["o"], plans.get("o", ()), dt, ("heads", None, None))
        ),
        "o_proj",
    )
    x = shard_activation(x + o, ("batch", "seq", None))

    h = rms_norm(x, layer["ffn_norm"], cfg.norm_eps)
    gate, up = _fused_gate_up(h, layer, plans)
    act = shard_activation(jax.nn.silu(gate) * up, ("batch", "seq", "ffn"))
    x = x + jnp.einsum(
        "bsf,fd->bsd", act, _weight(layer["down"], plans.get("down", ()), dt, ("ffn", None))
    )
    return shard_activation(x, ("batch", "seq", None))


def _remat(fn, policy: str, *, in_scan: bool):
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, prevent_cse=not in_scan)
    if policy in _SAVED_BY_POLICY:
        saved = jax.checkpoint_policies.save_only_these_names(*_SAVED_BY_POLICY[policy])
        return jax.checkpoint(fn, policy=saved, prevent_cse=not in_scan)
    if policy == AUTO:
        raise ValueError(_UNRESOLVED.format(key="model.remat"))
    raise ValueError(f"model.remat = {policy!r}: not one of {REMAT_POLICIES}")


def _unstack(tree, n: int) -> list:
    """[n, ...]-stacked tree -> list of n trees (one split per leaf: its gradient is a concat)."""
    parts = jax.tree.map(lambda a: [s[0] for s in jnp.split(a, n, axis=0)], tree)
    leaf = lambda p: isinstance(p, list)  # noqa: E731
    return [jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=leaf) for i in range(n)]


def _layer_plans(plans: dict | None) -> dict:
    """Gather plans of one layer's leaves from those of the stacked [L, ...] leaves."""
    layers = (plans or {}).get("layers", {})
    return {n: tuple((d - 1, axes) for d, axes in p) for n, p in layers.items()}


def embedding_table(params, cfg: ModelConfig, plans: dict | None = None):
    """The tied table float32 [V, D] holding compute-dtype values (exact to cast again), whole
    along `plans["embed"]`: gathered once, in the compute dtype, for the lookup and the LM head
    (its gradient, summed over both uses and the loss chunks in float32, is reduce-scattered
    in the compute dtype). A lookup into a table sharded on the embed dimension crashes XLA's
    partitioner inside a shard_map manual over "data" (jax 0.10.2), so it is always whole.
    Without a plan: `params["embed"]` itself, so that the program left to the partitioner is
    the one it was (the lookup gathers a compute-dtype copy, the LM head casts per chunk)."""
    dt = jnp.dtype(cfg.compute_dtype)
    plan = (plans or {}).get("embed", ())
    if not plan:  # whole, or left to the partitioner: the f32 parameter, cast where it is used
        return params["embed"]
    table = _weight(params["embed"], plan, dt, ("vocab", None)).astype(jnp.float32)
    return shard_activation(table, ("vocab", None))


def _hidden(params, table, tokens, cfg: ModelConfig, plans: dict | None):
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if tokens.shape[1] > cfg.max_seq_len:
        raise ValueError(f"sequence {tokens.shape[1]} > model.max_seq_len {cfg.max_seq_len}")
    dt = jnp.dtype(cfg.compute_dtype)
    # gather the table over its embed (fsdp) dimension first, in the compute dtype, as FSDP does
    # for every weight (a no-op where `embedding_table` already gathered it)
    table = shard_activation(table.astype(dt), ("vocab", None))
    x = shard_activation(jnp.take(table, tokens, axis=0), ("batch", "seq", None))
    block = functools.partial(_block, cfg=cfg, plans=_layer_plans(plans))
    if cfg.layer_loop == "scan":
        block = _remat(block, cfg.remat, in_scan=True)
        x, _ = jax.lax.scan(lambda c, layer: (block(c, layer), None), x, params["layers"])
    elif cfg.layer_loop == "unroll":
        block = _remat(block, cfg.remat, in_scan=False)
        for layer in _unstack(params["layers"], cfg.num_layers):
            if plans:  # each layer's weight gradients before the previous layer's backward
                x, layer = gather_once.tie_backward(x, layer, *layer_tie_specs(x, layer, cfg))
            x = block(x, layer)
    else:
        raise ValueError(f"model.layer_loop = {cfg.layer_loop!r}: not one of {LAYER_LOOPS}")
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def hidden_states(params, tokens, cfg: ModelConfig):
    """Final-normed hidden states [B, S, D] in the compute dtype. tokens int32 [B, S]."""
    return _hidden(params, embedding_table(params, cfg), tokens, cfg, None)


def forward(params, tokens, cfg: ModelConfig):
    """Logits float32 [B, S, V] for tokens int32 [B, S] (LM head tied to the embedding)."""
    return lm_logits(hidden_states(params, tokens, cfg), params["embed"])


def loss_sums(params, batch, cfg: ModelConfig, plans: dict | None = None):
    """(total, count, per_example): the masked sum of per-token losses float32 [], the mask's
    sum float32 [], the per-row mean float32 [B] (0 for a row without targets). `plans`: a tree
    like params of the dimensions to gather (`trn_accum.model.fsdp`), None = params whole."""
    mask = batch["target_mask"]
    on = mask != 0
    weight = mask.astype(jnp.float32)
    labels = jnp.where(on, batch["target_labels"], 0)
    table = embedding_table(params, cfg, plans)
    hidden = _hidden(params, table, batch["input_ids"], cfg, plans)
    # loss_chunk counts tokens per batch shard: a chunk of the global minibatch is loss_chunk x
    # its shards, so the chunk loop runs (tokens per shard / loss_chunk) times on any mesh and
    # node count (one compile on 2 nodes then stands for 32; see trn_accum.analysis.steptime)
    if cfg.loss_chunk == AUTO:
        raise ValueError(_UNRESOLVED.format(key="model.loss_chunk"))
    shards = batch_groups(labels.shape[0])
    chunk = min(cfg.loss_chunk * shards, labels.size) if cfg.loss_chunk else None
    per_token = cross_entropy(
        hidden,
        table,
        labels,
        chunk=chunk,
        groups=batch_groups(chunk) if chunk else 1,
        shard=shard_activation,
    )
    per_token = jnp.where(on, per_token * weight, 0.0)
    row_sum, row_weight = per_token.sum(axis=-1), weight.sum(axis=-1)
    per_example = jnp.where(row_weight > 0, row_sum / jnp.where(row_weight > 0, row_weight, 1), 0)
    return row_sum.sum(), row_weight.sum(), per_example


def mean_loss(total, count):
    """total / count, 0 when count is 0 (and a zero gradient)."""
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0.0)


def loss_fn(params, batch, cfg: ModelConfig):
    """Next-token cross-entropy, mean over target tokens whose mask is on.

    batch: {"input_ids": int32 [B, S], "target_labels": int32 [B, S],
            "target_mask": bool or float32 [B, S]} (a float mask weights tokens; 0 = off).
    Returns (loss float32 [], aux) with aux = {"per_example_loss": float32 [B] (0 for a row
    without targets), "num_target_tokens": float32 [] (the mask's sum)}. A batch without
    targets has loss 0 and zero gradients. Labels under a zero mask may be anything (e.g. -100).
    """
    total, count, per_example = loss_sums(params, batch, cfg)
    return mean_loss(total, count), {"per_example_loss": per_example, "num_target_tokens": count}
