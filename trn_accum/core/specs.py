"""PartitionSpec helpers: reading specs, cutting them to a leaf, checking them against a mesh
and a shape, one spec (or sharding) per leaf of a batch or parameter tree.

Pure functions over `PartitionSpec`s, meshes and shapes; nothing here traces or moves data.
Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "as_spec",
    "batch_shard_count",
    "check_spec_axes",
    "check_spec_fits",
    "cut_spec",
    "drop_axes",
    "is_sharding_leaf",
    "is_spec",
    "leaf_shardings",
    "leaf_specs",
    "mesh_str",
    "path_str",
    "spec_axes",
]


def is_spec(x: Any) -> bool:
    """A PartitionSpec or None (None = replicated): a leaf of a spec tree."""
    return isinstance(x, P) or x is None


def as_spec(x: P | None) -> P:
    """`x`, with None read as P() (replicated)."""
    return P() if x is None else x


def cut_spec(spec: P | None, ndim: int) -> P:
    """A spec cut to a leaf's rank (extra trailing entries dropped; shorter = replicated)."""
    spec = as_spec(spec)
    return P(*tuple(spec)[:ndim])


def spec_axes(entry: Any) -> tuple[str, ...]:
    """Mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for e in entry for a in spec_axes(e))
    if entry is P.UNCONSTRAINED:
        return ()
    return (entry,)


def drop_axes(spec: P | None, axes: Collection[str]) -> P:
    """`spec` without the named mesh axes (an entry left empty becomes None)."""
    out = []
    for entry in as_spec(spec):
        if isinstance(entry, (tuple, list)):
            kept = tuple(a for a in entry if a not in axes)
            out.append(kept if len(kept) > 1 else (kept[0] if kept else None))
        else:
            out.append(None if entry in axes else entry)
    return P(*out)


def check_spec_axes(spec: P, mesh: Mesh, *, what: str = "batch_spec") -> None:
    """ValueError if `spec` names an axis that `mesh` lacks."""
    for entry in spec:
        for axis in spec_axes(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{what} {spec} names mesh axis {axis!r}, which the mesh "
                    f"({mesh_str(mesh)}) lacks; use one of {tuple(mesh.axis_names)} "
                    "or add the axis to the mesh"
                )


def check_spec_fits(spec: P, shape: Sequence[int], mesh: Mesh, *, what: str) -> None:
    """ValueError unless `spec` can shard an array of `shape` on `mesh`: its axes exist, it has
    at most rank entries, and every dimension divides by the product of its axes' sizes (what
    `jax.device_put` requires). The message names `what` (e.g. the leaf path), the dimension,
    the axis sizes and a fix."""
    check_spec_axes(spec, mesh, what=what)
    shape = tuple(int(d) for d in shape)
    if len(spec) > len(shape):
        raise ValueError(
            f"{what} = {spec} has {len(spec)} entries but the array has rank {len(shape)} "
            f"(shape {shape}); drop the extra entries"
        )
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        axes = spec_axes(entry)
        shards = math.prod(mesh.shape[a] for a in axes)
        if size % shards:
            sizes = " × ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"{what} = {spec} does not fit shape {shape}: dimension {dim} has size {size}, "
                f"not divisible by {sizes} = {shards}; replicate that dimension (None), shard a "
                f"dimension whose size divides by {shards}, or change the mesh"
            )


def batch_shard_count(spec: P | None, mesh: Mesh | None) -> int:
    """Number of shards of axis 0 under `spec` on `mesh` (1 without a mesh or a batch axis)."""
    spec = as_spec(spec)
    if mesh is None or len(spec) == 0:
        return 1
    return math.prod(mesh.shape[a] for a in spec_axes(spec[0]))


def mesh_str(mesh: Mesh) -> str:
    return ", ".join(f"{n}={s}" for n, s in mesh.shape.items())


def path_str(path: Sequence[Any]) -> str:
    s = jax.tree_util.keystr(tuple(path))
    return s if s else "<root>"


def leaf_specs(batch: Any, batch_spec: Any) -> list[P]:
    """One PartitionSpec per leaf of `batch` (in `jax.tree.leaves` order), cut to its rank.

    `batch_spec`: None (replicated), one PartitionSpec for every leaf, or a pytree of specs
    that is a prefix of `batch`'s structure.
    """
    leaves = jax.tree.leaves(batch)
    if is_spec(batch_spec):
        return [cut_spec(batch_spec, np.ndim(x)) for x in leaves]
    try:
        full = jax.tree.broadcast(batch_spec, batch, is_leaf=is_spec)
    except ValueError as e:
        raise ValueError(
            f"batch_spec must be one PartitionSpec or a pytree prefix of the batch: {e}"
        ) from None
    specs = jax.tree.leaves(full, is_leaf=is_spec)
    return [cut_spec(s, np.ndim(x)) for s, x in zip(specs, leaves, strict=True)]


def is_sharding_leaf(x: Any) -> bool:
    """A leaf of a parameter-spec tree: a PartitionSpec, a NamedSharding, or None."""
    return x is None or isinstance(x, (P, NamedSharding))


_NO_CONSTRAINT = object()  # stands for a None spec while broadcasting


def leaf_shardings(specs: Any, tree: Any, mesh: Mesh | None, *, what: str) -> list | None:
    """One `(mesh, PartitionSpec)` or None (no constraint) per leaf of `tree`, in
    `jax.tree.leaves` order; None when `specs` is None.

    `specs` is a pytree prefix of `tree` whose leaves are PartitionSpecs (on `mesh`),
    NamedShardings (on their own mesh) or None (no constraint for that subtree). As in
    `jax.tree` functions, None leaves and empty subtrees of `tree` (e.g. `eqx.partition`'s
    holes) have no leaves, so they get nothing; a spec standing over them is unused. Every
    spec is checked against its leaf's shape (`check_spec_fits`); `what` names the tree in
    messages, e.g. "param_specs".
    """
    if specs is None:
        return None
    marked = jax.tree.map(
        lambda s: _NO_CONSTRAINT if s is None else s, specs, is_leaf=is_sharding_leaf
    )

    def is_leaf(x):
        return x is _NO_CONSTRAINT or isinstance(x, (P, NamedSharding))

    try:
        full = jax.tree.broadcast(marked, tree, is_leaf=is_leaf)
    except ValueError as e:
        raise ValueError(f"{what} must be a pytree prefix of the parameters: {e}") from None
    out = []
    flat = jax.tree.leaves(full, is_leaf=is_leaf)
    for (path, x), spec in zip(jax.tree.flatten_with_path(tree)[0], flat, strict=True):
        where, on = f"{what}{jax.tree_util.keystr(path)}", mesh
        if isinstance(spec, NamedSharding):
            on, spec = spec.mesh, spec.spec
        if spec is not _NO_CONSTRAINT:
            if on is None:
                raise ValueError(f"{where} = {spec} needs mesh=... (or a NamedSharding)")
            check_spec_fits(spec, np.shape(x), on, what=where)
        out.append(None if spec is _NO_CONSTRAINT else (on, spec))
    return out
