"""Meshes of any axis types for `accumulate_gradients`: Explicit (`jax.make_mesh`'s default
in JAX 0.10), Manual or Auto.

The accumulation core states its shardings with sharding constraints, which need Auto axes.
A mesh with other axis types is swapped for the same devices and names with Auto axes
(`auto_mesh`), and the caller's arrays committed to the original mesh are re-labelled onto it
(`onto_mesh`: same devices, same spec, no data moves). Tracers typed on Explicit axes (a
`jax.jit` around grad_fn on Explicit-sharded arrays) are re-typed inside the trace instead
(`via_auto_axes`, what `jax.sharding.auto_axes` does): the arguments to Auto axes, the core
inline, its outputs back to Explicit types (`explicit_out_specs`). Both re-typings are layout
annotations that move no data. Manual axes (inside `shard_map`) cannot become Auto:
`check_traced` refuses them, naming the fix.

Imports JAX only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "auto_mesh",
    "check_traced",
    "explicit_out_specs",
    "is_auto",
    "on_auto_mesh",
    "onto_mesh",
    "via_auto_axes",
]

AUTO_FIX = (
    "trn_accum.build_mesh({...}) or "
    "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
)


def is_auto(mesh: Any) -> bool:
    """True when every axis of `mesh` (a Mesh or AbstractMesh) is Auto (an empty mesh is)."""
    return all(t == AxisType.Auto for t in (getattr(mesh, "axis_types", None) or ()))


def auto_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh` with every axis Auto: same devices [*shape], same names (None stays None)."""
    if mesh is None or is_auto(mesh):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _same_devices(a: Mesh, b: Mesh) -> bool:
    return a.axis_names == b.axis_names and np.array_equal(a.devices, b.devices)


def onto_mesh(x: Any, mesh: Mesh) -> Any:
    """An array committed to a non-Auto twin of `mesh` (same devices and names) -> the same
    data with the same spec on `mesh`; anything else unchanged."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or is_auto(sharding.mesh):
        return x
    if not isinstance(sharding.mesh, Mesh) or not _same_devices(sharding.mesh, mesh):
        return x
    return jax.device_put(x, NamedSharding(mesh, sharding.spec))


def typed_mesh(leaves: list) -> Any:
    """The first mesh with a non-Auto axis among the ambient abstract mesh and the types of
    `leaves` (tracers of the caller's trace), or None."""
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [getattr(jax.typeof(x).sharding, "mesh", None) for x in leaves]
    return next((m for m in meshes if m is not None and not is_auto(m)), None)


def check_traced(typed: Any, mesh: Mesh | None) -> None:
    """ValueError when grad_fn is traced on mesh `typed` (not None: `typed_mesh`) with a Manual
    axis (inside `shard_map`: it cannot become Auto), or on axes other than `mesh`'s."""
    where = (
        f"grad_fn is traced on arrays typed on mesh axes {dict(typed.shape)} with axis types "
        f"{tuple(t.name for t in typed.axis_types)}"
    )
    if any(t == AxisType.Manual for t in typed.axis_types):
        raise ValueError(
            f"{where}; Manual axes (inside shard_map) cannot be turned into the Auto axes "
            f"trn_accum needs: call grad_fn outside shard_map, or build the mesh with {AUTO_FIX}"
        )
    if mesh is not None and dict(typed.shape) != dict(mesh.shape):
        raise ValueError(
            f"{where}, but accumulate_gradients was given mesh axes {dict(mesh.shape)}: "
            "pass the mesh the arrays are sharded on"
        )


def explicit_out_specs(out: Any, params: Any, batch: Any) -> Any:
    """PartitionSpecs on Explicit axes for grad_fn's `out` = ((value, grads), stats): each
    gradient typed like its parameter (as `jax.grad` types it), per-example value leaves
    ([B, ...], B = the batch's rows) laid out like the batch rows, the rest replicated."""
    (value, grads), stats = out
    rows = jax.tree.leaves(batch)[0]
    row_spec = P(*jax.typeof(rows).sharding.spec[:1])

    def value_spec(x):
        per_example = np.ndim(x) >= 1 and np.shape(x)[0] == np.shape(rows)[0]
        return row_spec if per_example else P()

    grad_specs = jax.tree.map(lambda g, p: jax.typeof(p).sharding.spec, grads, params)
    return (jax.tree.map(value_spec, value), grad_specs), jax.tree.map(lambda _: P(), stats)


def via_auto_axes(inline: Callable, typed: Any) -> Callable:
    """`inline(params, batch, *args)` run on tracers typed on `typed` (an abstract mesh with
    Explicit axes): arguments re-typed to the same mesh with Auto axes, `inline` under it,
    its outputs re-typed back (`explicit_out_specs`), as `jax.sharding.auto_axes` does."""
    auto = typed.update_axis_types({a: AxisType.Auto for a in typed.axis_names})

    def run(params, batch, *args):
        with jax.sharding.use_abstract_mesh(auto):
            moved = jax.sharding.reshard((params, batch, args), P())  # Auto: no axis named
            out = inline(moved[0], moved[1], *moved[2])
        specs = explicit_out_specs(out, params, batch)
        return jax.sharding.reshard(out, jax.tree.map(lambda s: NamedSharding(typed, s), specs))

    return run


def on_auto_mesh(compiled: Callable, inline: Callable, mesh: Mesh | None) -> Callable:
    """grad_fn(params, batch, *args): `inline` inside a caller's trace (through
    `via_auto_axes` on tracers typed on Explicit axes), else `compiled` on the arguments
    moved `onto_mesh` (under `jax.set_mesh(mesh)` when the ambient mesh is not Auto)."""

    def grad_fn(params, batch, *args):
        leaves = jax.tree.leaves((params, batch, args))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            typed = typed_mesh(leaves)
            if typed is None:
                return inline(params, batch, *args)  # in the caller's trace: inline
            check_traced(typed, mesh)
            return via_auto_axes(inline, typed)(params, batch, *args)
        if mesh is None:
            return compiled(params, batch, *args)  # eager: jit's cache, one compile each
        params, batch, args = jax.tree.map(lambda x: onto_mesh(x, mesh), (params, batch, args))
        if is_auto(jax.sharding.get_abstract_mesh()):
            return compiled(params, batch, *args)
        with jax.set_mesh(mesh):
            return compiled(params, batch, *args)

    return grad_fn
