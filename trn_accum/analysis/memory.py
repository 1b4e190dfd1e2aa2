"""Per-device memory on paper: exact shard bytes of a sharded tree, and an analytic activation
estimate of one minibatch of the Fuji step (what the compiled CPU figures are read against).

Functions take shapes, PartitionSpecs and a config object (anything with `.model` and `.data`
shaped like `trn_accum.config.load.Config`); nothing is compiled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trn_accum.core.batch_rules import valid_steps
from trn_accum.core.specs import drop_axes, spec_axes

GIB = 1024**3


def format_bytes(x: float) -> str:
    """Bytes in GiB, MiB or KiB (the largest unit of which `x` is at least a tenth), else B."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= 0.1 * scale:
            return f"{x / scale:.2f} {unit}"
    return f"{int(x)} B"


def extrapolate(depth_bytes: Mapping[int, int], layers: int) -> int:
    """The straight line through two compiled depths {L1: b1, L2: b2}, at `layers`:
    b(L) = b2 + (b2 - b1) / (L2 - L1) x (L - L2), rounded up (per-layer figures of a program
    too slow to compile at full depth)."""
    if len(depth_bytes) != 2:
        raise ValueError(f"extrapolate needs two depths, got {dict(depth_bytes)}")
    (l1, b1), (l2, b2) = sorted(depth_bytes.items())
    if l1 == l2:
        raise ValueError(f"extrapolate needs two different depths, got {dict(depth_bytes)}")
    return int(math.ceil(b2 + (b2 - b1) / (l2 - l1) * (layers - l2)))


def shard_bytes(shape: Sequence[int], dtype, spec: P, mesh_shape: Mapping[str, int]) -> int:
    """Bytes of one device's shard of an array of `shape` under `spec` on a mesh of that shape
    (a dimension not divisible by its axes is padded, as XLA does)."""
    dims = []
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    for d, entry in zip(shape, entries, strict=True):
        n = math.prod(mesh_shape.get(a, 1) for a in spec_axes(entry))
        dims.append(-(-d // n))
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def tree_shard_bytes(abstract, specs, mesh_shape: Mapping[str, int]) -> int:
    leaves = jax.tree.leaves(abstract)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(
        shard_bytes(a.shape, a.dtype, s, mesh_shape)
        for a, s in zip(leaves, spec_leaves, strict=True)
    )


def state_shard_bytes(abstract_state, param_specs, opt_specs, mesh_shape) -> dict[str, int]:
    """Per-device bytes of a train state's parameters, their float32 gradient (the
    accumulator; the trainer asks for float32 gradients) and the optimizer state, on a mesh of
    `mesh_shape`. `abstract_state`: {"params", "opt_state", ...} of ShapeDtypeStructs."""
    params = abstract_state["params"]
    f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params)
    return {
        "params": tree_shard_bytes(params, param_specs, mesh_shape),
        "grads": tree_shard_bytes(f32, param_specs, mesh_shape),
        "opt_state": tree_shard_bytes(abstract_state["opt_state"], opt_specs, mesh_shape),
    }


def gather_once_bytes(params, param_specs, mesh_shape, axes, compute_dtype, mode: str) -> int:
    """Extra per-device bytes of `gather` = `mode` (`trn_accum.core.gather_once`) over the
    per_minibatch program: each parameter sharded over `axes` gathered full along them (the
    `compute_dtype` buffer that travels and its cast back to the parameter's dtype), and one
    minibatch's float32 gradient at that full size instead of the shard; "once_unsharded" also
    the float32 accumulator at full size. 0 for "per_minibatch"."""
    if mode == "per_minibatch":
        return 0
    c = jnp.dtype(compute_dtype).itemsize
    spec_leaves = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    extra = 0
    for a, spec in zip(jax.tree.leaves(params), spec_leaves, strict=True):
        if not any(ax in axes for e in spec for ax in spec_axes(e)):
            continue
        full = shard_bytes(a.shape, jnp.float32, drop_axes(spec, axes), mesh_shape) // 4  # elements
        shard = shard_bytes(a.shape, jnp.float32, spec, mesh_shape) // 4
        grads = (2 if mode == "once_unsharded" else 1) * 4 * (full - shard)
        extra += (c + a.dtype.itemsize) * full + grads
    return extra


def activation_estimate(cfg: Any, rows_per_minibatch: int, model_axis: int) -> dict[str, Any]:
    """Analytic per-device activation bytes of one minibatch (forward kept for backward).

    t = rows per device group per minibatch x seq tokens (replicated over the `model` axis;
    heads and FFN hidden split over it), c = compute bytes. Saved per layer: remat "full":
    the layer input (t·D·c); "save_qkvo": + q, k, v, context (t·(2H+2KV)·Dh/m·c) + o projection
    (t·D·c); "save_attention": + the blockwise or flash attention's own residuals, its output
    and float32 log-sum-exp (t·H/m·(Dh·c + 4)); "none": everything a layer makes (+ norms, FFN
    gate/up/act, attention scores when plain). Plus the working set of one layer recomputed in
    backward, the logits (float32, vocabulary split over `model`; one chunk when loss_chunk > 0)
    and the all-gathered bf16 weights of one layer and of the embedding (FSDP).
    """
    m = cfg.model
    mp = max(1, model_axis)
    c = jnp.dtype(m.compute_dtype).itemsize
    s = cfg.data.seq_len
    t = rows_per_minibatch * s
    d, h, kv, dh, f, v = (
        m.hidden_dim,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.ffn_dim,
        m.vocab_size,
    )
    qkvc = t * (2 * h + 2 * kv) * dh // mp * c
    if m.attention == "plain":
        scores = rows_per_minibatch * (h // mp) * s * s * 4 * 2  # scores + probs, float32
    else:
        blk = min(m.attention_block, s)
        scores = rows_per_minibatch * (h // mp) * s * blk * 4 * 2
    full_layer = t * c * (5 * d) + qkvc + t * c * 3 * f // mp + scores
    residuals = t * (h // mp) * (dh * c + 4) if m.names_attention_residuals else 0
    qkvo = t * d * c + qkvc + t * d * c  # the layer input, q/k/v/context and the o projection
    per_layer = {
        "full": t * d * c,
        "save_qkvo": qkvo,
        "save_attention": qkvo + residuals,
        "none": full_layer,
    }[m.remat]
    logit_tokens = t if m.loss_chunk <= 0 else min(t, m.loss_chunk)
    logits = logit_tokens * (v // mp) * 4 * 2  # logits and their gradient, float32
    layer_weights = (d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f) // mp * c
    gathered = 2 * layer_weights + v * d // mp * c
    saved = per_layer * m.num_layers
    total = saved + full_layer + logits + gathered
    return {
        "tokens_per_device": t,
        "saved_per_layer": per_layer,
        "saved_all_layers": saved,
        "one_layer_recompute": full_layer,
        "logits": logits,
        "gathered_weights": gathered,
        "total": total,
    }


def fit_by_steps(
    cfg: Any, mesh_per_node: Mapping[str, int], fixed_bytes: int, nodes: int, budget: float
) -> dict[str, Any]:
    """Analytic per-device bytes for every valid accum_steps k at `nodes` nodes, and the
    smallest k that fits `budget` (None if none does).

    fixed_bytes: what does not depend on k (parameters, optimizer state, the float32
    accumulator and one minibatch's gradient). Per-device state is the same for any node count
    (nodes replicate over `data`); only the rows per device group change:
    global_batch / nodes / (data x fsdp per node)."""
    groups = mesh_per_node.get("data", 1) * mesh_per_node.get("fsdp", 1)
    b = cfg.data.global_batch
    if b % nodes or (b // nodes) % groups:
        return {"nodes": nodes, "rows_per_group": None, "table": [], "accum_steps": None}
    rows = b // nodes // groups
    table = []
    for k in valid_steps(rows, 1):
        act = activation_estimate(cfg, rows // k, mesh_per_node.get("model", 1))
        table.append({"k": k, "rows_per_minibatch": rows // k, "bytes": fixed_bytes + act["total"]})
    fits = [row["k"] for row in table if row["bytes"] <= budget]
    return {
        "nodes": nodes,
        "rows_per_group": rows,
        "table": table,
        "accum_steps": min(fits, default=None),
    }


def compiled_memory(compiled) -> dict[str, int] | None:
    """`compiled.memory_analysis()` per device as {argument, output, alias, temp,
    generated_code} bytes, or None where the backend reports none."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # a backend without memory analysis
        return None
    if stats is None:
        return None
    keys = ("argument", "output", "alias", "temp", "generated_code")
    return {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0) for k in keys}


def footprint(mem: Mapping[str, int] | None) -> int | None:
    """The compiled footprint per device: arguments + outputs - aliased (donated) + temps."""
    if mem is None:
        return None
    return mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
