"""Meshes of any axis types for `accumulate_gradients`: Explicit (`jax.make_mesh`'s default
in JAX 0.10), Manual or Auto.

The accumulation core states its shardings with sharding constraints, which need Auto axes.
A mesh with other axis types is swapped for the same devices and names with Auto axes
(`auto_mesh`), and the caller's arrays committed to the original mesh are re-labelled onto it
(`onto_mesh`: same devices, same spec, no data moves). Tracers typed on Explicit axes (a
`jax.jit` around grad_fn on Explicit-sharded arrays) cannot be re-labelled inside the trace:
`check_traced` refuses them, naming the fix.

Imports JAX only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

__all__ = ["auto_mesh", "check_traced", "is_auto", "on_auto_mesh", "onto_mesh"]

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


def check_traced(leaves: list) -> None:
    """ValueError when grad_fn is traced (inside the caller's `jax.jit`) on Explicit axes."""
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [getattr(jax.typeof(x).sharding, "mesh", None) for x in leaves]
    bad = next((m for m in meshes if m is not None and not is_auto(m)), None)
    if bad is not None:
        raise ValueError(
            f"grad_fn is traced on arrays typed on mesh axes {dict(bad.shape)} with axis types "
            f"{tuple(t.name for t in bad.axis_types)}; inside a trace trn_accum needs Auto axes: "
            f"call grad_fn outside jax.jit (it compiles itself), or build the mesh with {AUTO_FIX}"
        )


def on_auto_mesh(compiled: Callable, inline: Callable, mesh: Mesh | None) -> Callable:
    """grad_fn(params, batch, *args): `inline` inside a caller's trace (`check_traced`),
    else `compiled` on the arguments moved `onto_mesh` (under `jax.set_mesh(mesh)` when the
    ambient mesh is not Auto)."""

    def grad_fn(params, batch, *args):
        leaves = jax.tree.leaves((params, batch, args))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            check_traced(leaves)
            return inline(params, batch, *args)  # in the caller's trace: inline
        if mesh is None:
            return compiled(params, batch, *args)  # eager: jit's cache, one compile each
        params, batch, args = jax.tree.map(lambda x: onto_mesh(x, mesh), (params, batch, args))
        if is_auto(jax.sharding.get_abstract_mesh()):
            return compiled(params, batch, *args)
        with jax.set_mesh(mesh):
            return compiled(params, batch, *args)

    return grad_fn
