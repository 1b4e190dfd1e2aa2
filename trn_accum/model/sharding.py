"""Where activations and gathered weights sit on the mesh's automatic axes: the kinds of their
dimensions ("batch", "seq", "heads", "ffn", "vocab") -> mesh axes. `trn_accum.model.fuji`
re-exports these names. Every `cfg` is a `trn_accum.model.fuji.ModelConfig` (not imported:
fuji imports this module).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from trn_accum.core.constraints import constrain
from trn_accum.model.params import param_axes

BATCH_AXES = ("data", "fsdp")
# Activation dimension kind -> mesh axes it is sharded over (those present, Auto and dividing).
_ACTIVATION_AXES = {
    "batch": BATCH_AXES,
    "seq": ("seq",),
    "heads": ("model",),
    "ffn": ("model",),
    "vocab": ("model",),
}


def activation_spec(shape: tuple[int, ...], dims: tuple[str | None, ...]) -> P | None:
    """The PartitionSpec `shard_activation` puts on an array of `shape` (None without a mesh or
    an automatic axis): per dimension, the axes of its kind in `dims` that the current mesh
    has, that are Auto and that keep it divisible."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Auto}
    if not auto:
        return None
    entries = []
    for size, kind in zip(shape, dims, strict=True):
        chosen, n = [], 1
        for a in _ACTIVATION_AXES.get(kind, ()):
            if a in auto and size % (n * mesh.shape[a]) == 0:
                chosen.append(a)
                n *= mesh.shape[a]
        entries.append(tuple(chosen) if len(chosen) > 1 else chosen[0] if chosen else None)
    return P(*entries)


def shard_activation(x, dims: tuple[str | None, ...]):
    """Constrain activation `x` when a mesh is active (`jax.set_mesh`); otherwise return it.

    `dims` names each dimension: "batch" -> the mesh's ("data", "fsdp") axes, "seq" -> "seq",
    "heads" / "ffn" / "vocab" -> "model", None -> replicated. Only axes that exist in the current
    mesh, are Auto (not Manual inside a shard_map, not Explicit) and keep the dimension divisible
    are used (`activation_spec`), so the same model runs on any mesh and inside
    `shard_map(..., axis_names={"data"})`. The constraint is `trn_accum.core.constraints.constrain`
    on the ambient mesh.
    """
    spec = activation_spec(x.shape, dims)
    if spec is None:
        return x
    return constrain(x, jax.sharding.get_abstract_mesh(), spec)


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


_PARAM_KINDS = {"heads": "heads", "kv_heads": "heads", "ffn": "ffn"}


def layer_tie_specs(x, layer, cfg):
    """(x's spec, {leaf: spec}) over the current mesh's automatic axes, for
    `gather_once.tie_backward` at a layer's input: x [B, S, D] as the blocks constrain it, each
    of the layer's leaves (one layer's shards, no leading L) by its logical axes read as
    activation kinds, as `trn_accum.model.fuji` gathers them; None without a mesh."""
    axes = param_axes(cfg)["layers"]
    kinds = {n: tuple(_PARAM_KINDS.get(a) for a in ax[1:]) for n, ax in axes.items()}
    specs = {n: activation_spec(w.shape, kinds[n]) for n, w in layer.items()}
    return activation_spec(x.shape, ("batch", "seq", None)), specs
