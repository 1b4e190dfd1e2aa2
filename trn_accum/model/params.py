"""Fuji parameters: one table gives the shape, logical axes and initialisation of every
parameter (the tree in `trn_accum.model.fuji`'s docstring); rule sets map logical axes to mesh
axes (`param_specs`). `trn_accum.model.fuji` re-exports every public name here. Every `cfg`
is a `trn_accum.model.fuji.ModelConfig` (not imported: fuji imports this module).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


@dataclasses.dataclass(frozen=True)
class _Param:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    fan: tuple[str, ...] = ()  # logical axes whose sizes multiply to the fan; () = norm scale 1


def _param_table(cfg) -> dict:
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


def _init_std(cfg, p: _Param) -> float | None:
    if not p.fan:
        return None
    if cfg.init == "normal":
        return cfg.init_std
    fan = math.prod(n for n, a in zip(p.shape, p.axes, strict=True) if a in p.fan)
    return 1.0 / math.sqrt(fan)


def param_init_stds(cfg) -> dict:
    """The initial std of every parameter (the parameter tree; None for the norm scales, which
    start at 1): `cfg.init` "fan_in" = 1/sqrt(fan) (q/k/v/gate/up: hidden; o: heads x
    head_dim; down: ffn; the embedding: its fan-out, hidden), "normal" = `cfg.init_std`."""
    return jax.tree.map(
        lambda p: _init_std(cfg, p),
        _param_table(cfg),
        is_leaf=lambda x: isinstance(x, _Param),
    )


def init_params(cfg, key) -> dict:
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


def param_shapes(cfg) -> dict:
    """Tree of `jax.ShapeDtypeStruct` (float32) matching `init_params`; no computation."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), _param_table(cfg))


def num_params(cfg) -> int:
    """Exact parameter count (the LM head is the embedding: counted once)."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(_param_table(cfg)))


def param_axes(cfg) -> dict:
    """Tree (same structure as the params) of tuples of logical axis names, one per dim."""
    return jax.tree.map(lambda p: p.axes, _param_table(cfg))


def param_specs(
    cfg,
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


def param_shardings(cfg, mesh: jax.sharding.Mesh, rules) -> dict:
    """Tree of NamedSharding on `mesh` (divisibility checked, see `param_specs`)."""
    specs = param_specs(cfg, rules, mesh.shape)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
