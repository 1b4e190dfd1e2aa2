"""Building meshes: the mesh-sizing rule (`-1` axes, device counts) and `build_mesh`.

`resolve_axes` is the one statement of the sizing rule (the trainer's config, its step and
the dry-run call it); `check_auto_mesh` states that the core's shardings need Auto axes
(`mesh_types` turns meshes of other axis types into such).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["build_mesh", "check_auto_mesh", "check_axis_sizes", "resolve_axes"]


def check_axis_sizes(axes: Mapping[str, int]) -> dict[str, int]:
    """`axes` as {name: int}; ValueError unless every size is an int >= 1 or -1 and at most one
    is -1. Needs no devices (the config checks this at load time)."""
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(f"mesh axes must be a non-empty mapping name -> size, got {axes!r}")
    sizes = {}
    for name, size in axes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"mesh axis {name}={size!r}: size must be an int (or -1)")
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name}={size}: size must be >= 1, or -1 for the rest")
        sizes[str(name)] = int(size)
    wild = [n for n, s in sizes.items() if s == -1]
    if len(wild) > 1:
        raise ValueError(f"mesh ({_sizes_str(sizes)}): at most one axis may be -1 ({wild})")
    return sizes


def _sizes_str(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{a}={s}" for a, s in sizes.items())


def resolve_axes(axes: Mapping[str, int], devices: int) -> dict[str, int]:
    """Mesh axis sizes over `devices` devices with the -1 (if any) resolved: the one statement
    of the mesh-sizing rule. ValueError (naming the sizes and the count) unless the sizes
    multiply to `devices`, or, with a -1, their product divides it."""
    sizes = check_axis_sizes(axes)
    shown = _sizes_str(sizes)
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if devices % known:
            raise ValueError(
                f"mesh ({shown}): the other axes use {known} devices, which does not divide the "
                f"{devices} devices; pick sizes whose product divides {devices}"
            )
        sizes = {a: (devices // known if s == -1 else s) for a, s in sizes.items()}
    if math.prod(sizes.values()) != devices:
        raise ValueError(
            f"mesh ({shown}) needs {math.prod(sizes.values())} devices but {devices} are "
            f"available; make the sizes multiply to {devices} or set one size to -1"
        )
    return sizes


def build_mesh(axes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with the axes in the order given, e.g. {"data": 2, "fsdp": -1, "model": 4}.

    One size may be -1: all remaining devices. Sizes must be positive ints whose product is
    the device count (`resolve_axes`; ValueError otherwise, naming the sizes and the count).
    Axis types are Auto (shardings are stated with constraints, as the accumulation core
    does). Devices: `jax.devices()` by default, laid out row-major in the order given
    (jax.make_mesh), so the leading axes span processes/nodes in a multi-process run.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axes(axes, len(devices))
    return jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes),
        axis_types=(AxisType.Auto,) * len(sizes),
        devices=devices,
    )


def check_auto_mesh(mesh: Mesh) -> None:
    """ValueError unless every mesh axis is Auto (shardings are stated with constraints)."""
    types = tuple(getattr(mesh, "axis_types", None) or ())
    bad = [n for n, t in zip(mesh.axis_names, types, strict=False) if t != AxisType.Auto]
    if bad:
        raise ValueError(
            f"mesh axes {tuple(bad)} have axis types {types}; trn_accum states shardings with "
            "sharding constraints and needs Auto axes: build the mesh with trn_accum.build_mesh "
            "or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)"
        )
