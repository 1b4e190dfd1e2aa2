"""Sharding constraints that work both in automatic code and inside a partially manual
`jax.shard_map` (reduce="once"): `constrain`, `constrain_leaves`, and `varying_like` for loop
carries built from constants inside the manual region.

Imports JAX only.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.core.specs import as_spec, drop_axes

__all__ = ["constrain", "constrain_leaves", "manual_axes", "varying_axes", "varying_like"]


def manual_axes() -> frozenset[str]:
    """Mesh axes that are Manual where this is traced (inside a `jax.shard_map` body)."""
    am = jax.sharding.get_abstract_mesh()
    types = getattr(am, "axis_types", ()) or ()
    return frozenset(n for n, t in zip(am.axis_names, types, strict=False) if t == AxisType.Manual)


def varying_axes(a: jax.Array) -> frozenset[str]:
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10; `vma` before
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like(x: Any, *like: jax.Array) -> Any:
    """`x` (a pytree) marked as varying over every manual axis any of `like` varies over, so a
    loop carry built from constants has the type its body returns inside `jax.shard_map`."""
    axes = tuple(sorted(set().union(*(varying_axes(a) for a in like))))
    if not axes:
        return x
    return jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), x)


def constrain(x: jax.Array, mesh: Mesh | None, spec: P | None) -> jax.Array:
    """`with_sharding_constraint(x, NamedSharding(mesh, spec))` that also works inside a
    partially manual `shard_map` (e.g. `accumulate_gradients(..., reduce="once")`): there the
    manual axes are dropped from `spec` and the constraint refers to the context mesh. Models
    should use it for their activation constraints so they run in both modes. `mesh` may be
    the ambient `jax.sharding.get_abstract_mesh()` (the spec then refers to the mesh set with
    `jax.set_mesh`). No-op when `mesh` is None."""
    if mesh is None:
        return x
    manual = manual_axes()
    if manual or isinstance(mesh, AbstractMesh):
        return jax.lax.with_sharding_constraint(x, drop_axes(spec, manual))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, as_spec(spec)))


def constrain_leaves(tree: Any, shardings: list | None) -> Any:
    """`tree` with leaf i constrained to `shardings[i]` = (mesh, spec) (None: left alone), the
    list `leaf_shardings` returns; `tree` itself when `shardings` is None."""
    if shardings is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = [x if ms is None else constrain(x, *ms) for x, ms in zip(leaves, shardings, strict=True)]
    return jax.tree.unflatten(treedef, out)
