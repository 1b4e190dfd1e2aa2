"""Static minibatch shardings: the strided split, its inverse, validation, and mesh building.

A global batch of B rows sharded on axis 0 over D devices (device d holds rows
[d·B/D, (d+1)·B/D)) is split into k minibatches *strided*: minibatch i = rows i, i+k, i+2k, ...

    stacked = x.reshape(B/k, k, *rest).swapaxes(0, 1)        # [k, B/k, *rest]

Row r = j·k + i lands at stacked[i, j]; device d's rows are j in [d·B/(k·D), (d+1)·B/(k·D)) for
every i, i.e. rows it already holds. So the stacked array's sharding is P(None, *batch_spec) and
each minibatch's is batch_spec, computable from the PartitionSpec alone, and the split moves no
data (a contiguous split, rows [i·B/k, (i+1)·B/k), would put minibatch 0 on the first D/k
devices). Requirement: B divisible by k·D. Non-batch axes keep their sharding.

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# fmt: off
__all__ = [
    "as_spec", "batch_shard_count", "build_mesh", "check_auto_mesh", "check_axis_sizes",
    "check_batch_spec_has_mesh", "check_spec_axes", "check_spec_fits", "constrain",
    "constrain_leaves", "cut_spec", "divisibility_error", "drop_axes", "is_sharding_leaf",
    "is_spec", "leaf_shardings", "leaf_specs", "manual_axes", "merge_minibatches",
    "minibatch_specs", "nearest_valid_steps", "resolve_axes", "spec_axes", "split_leaf",
    "split_minibatches", "valid_steps", "validate_batch", "validate_steps", "varying_like",
]
# fmt: on


# ----------------------------------------------------------------------------- specs


def is_spec(x: Any) -> bool:
    """A PartitionSpec or None (None = replicated): a leaf of a spec tree."""
    return isinstance(x, P) or x is None


def as_spec(x: P | None) -> P:
    """`x`, with None read as P() (replicated)."""
    return P() if x is None else x


def validate_steps(steps: Any) -> int:
    """`steps` must be an int >= 1 (a static Python int, not a traced value)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise ValueError(
            f"steps={steps!r} must be a Python int >= 1 (the number of accumulation "
            "minibatches is static)"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1 (1 = no accumulation)")
    return int(steps)


def minibatch_specs(batch_spec: Any, steps: int) -> tuple[Any, Any]:
    """(stacked_spec, minibatch_spec) for a batch spec (or a pytree of specs), before tracing.

    stacked_spec = P(None, *batch_spec) for the [k, B/k, ...] stack; minibatch_spec =
    batch_spec for each [B/k, ...] minibatch. `None` (anywhere) means P() (replicated). Pure:
    no mesh, no arrays, same answer for every k >= 1.
    """
    validate_steps(steps)
    if is_spec(batch_spec):
        spec = as_spec(batch_spec)
        return P(None, *spec), spec
    stacked = jax.tree.map(lambda s: P(None, *as_spec(s)), batch_spec, is_leaf=is_spec)
    mini = jax.tree.map(as_spec, batch_spec, is_leaf=is_spec)
    return stacked, mini


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


def check_spec_axes(spec: P, mesh: Mesh, *, what: str = "batch_spec") -> None:
    """ValueError if `spec` names an axis that `mesh` lacks."""
    for entry in spec:
        for axis in spec_axes(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{what} {spec} names mesh axis {axis!r}, which the mesh "
                    f"({_mesh_str(mesh)}) lacks; use one of {tuple(mesh.axis_names)} "
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


def batch_shard_count(spec: P | None, mesh: Mesh | None) -> int:
    """Number of shards of axis 0 under `spec` on `mesh` (1 without a mesh or a batch axis)."""
    spec = as_spec(spec)
    if mesh is None or len(spec) == 0:
        return 1
    return math.prod(mesh.shape[a] for a in spec_axes(spec[0]))


def _mesh_str(mesh: Mesh) -> str:
    return ", ".join(f"{n}={s}" for n, s in mesh.shape.items())


def _path_str(path: Sequence[Any]) -> str:
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


def constrain_leaves(tree: Any, shardings: list | None) -> Any:
    """`tree` with leaf i constrained to `shardings[i]` = (mesh, spec) (None: left alone), the
    list `leaf_shardings` returns; `tree` itself when `shardings` is None."""
    if shardings is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = [x if ms is None else constrain(x, *ms) for x, ms in zip(leaves, shardings, strict=True)]
    return jax.tree.unflatten(treedef, out)


def valid_steps(batch_size: int, shards: int) -> tuple[int, ...]:
    """Every k >= 1 with `batch_size` divisible by k × `shards`, ascending; () when `shards`
    does not divide `batch_size` at all. The one statement of the divisibility rule."""
    if shards < 1 or batch_size < 1 or batch_size % shards:
        return ()
    per_shard = batch_size // shards
    return tuple(d for d in range(1, per_shard + 1) if per_shard % d == 0)


def nearest_valid_steps(batch_size: int, shards: int, steps: int) -> int | None:
    """The k closest to `steps` with batch_size divisible by k·shards (ties: the larger k);
    None if batch_size is not divisible by shards at all."""
    ks = valid_steps(batch_size, shards)
    return min(ks, key=lambda d: (abs(d - steps), -d)) if ks else None


def divisibility_error(batch_size: int, steps: int, shards: int, *, axes: str = "") -> str | None:
    """None when `batch_size` divides by `steps` × `shards`; otherwise the rule and the fix as
    one clause, which callers prefix with where the numbers came from, e.g. "global batch size
    B=48 is not divisible by steps k=4 × 8 batch shards (mesh axes ('data', 'fsdp')) = 32;
    nearest valid steps: k=3, or use a batch size that is a multiple of 32"."""
    if batch_size % (steps * shards) == 0:
        return None
    nearest = nearest_valid_steps(batch_size, shards, steps)
    fix = (
        f"nearest valid steps: k={nearest}"
        if nearest is not None
        else f"no k works: B is not divisible by the {shards} batch shards"
    )
    where = f" ({axes})" if axes else ""
    return (
        f"global batch size B={batch_size} is not divisible by steps k={steps} × {shards} "
        f"batch shards{where} = {steps * shards}; {fix}, or use a batch size that is a multiple "
        f"of {steps * shards}"
    )


def validate_batch(
    batch: Any, steps: int, *, mesh: Mesh | None = None, batch_spec: Any = None
) -> tuple[int, list[P]]:
    """Check a batch against k = steps and the mesh; return (B, per-leaf specs).

    ValueError (at trace time: shapes are static) when: steps < 1; `batch_spec` comes without
    `mesh`; a leaf has no batch axis; leaves disagree on B; a spec names an axis the mesh
    lacks; B is not divisible by k × (shards of the batch axes); another dimension does not
    divide by its axes (`check_spec_fits`). Messages name the leaf, the numbers and a fix.
    """
    steps = validate_steps(steps)
    check_batch_spec_has_mesh(batch_spec, mesh)
    flat, _ = jax.tree.flatten_with_path(batch)
    if not flat:
        raise ValueError("the batch has no array leaves")
    specs = leaf_specs(batch, batch_spec)
    if mesh is not None:
        check_auto_mesh(mesh)
        for spec in specs:
            check_spec_axes(spec, mesh)
    sizes = {}
    for path, x in flat:
        if np.ndim(x) == 0:
            raise ValueError(
                f"batch leaf {_path_str(path)} is a scalar; every batch leaf needs the batch "
                "size on axis 0 (pass scalars as extra arguments instead)"
            )
        sizes.setdefault(int(np.shape(x)[0]), []).append(_path_str(path))
    if len(sizes) > 1:
        detail = "; ".join(f"B={b}: {', '.join(p[:4])}" for b, p in sorted(sizes.items()))
        raise ValueError(
            f"batch leaves disagree on the batch size (axis 0): {detail}; every leaf must "
            "have the same global batch size"
        )
    batch_size = next(iter(sizes))
    for (path, x), spec in zip(flat, specs, strict=True):
        axes = spec_axes(spec[0]) if len(spec) else ()
        error = divisibility_error(
            batch_size, steps, batch_shard_count(spec, mesh), axes=f"mesh axes {axes}"
        )
        if error:
            raise ValueError(f"batch leaf {_path_str(path)}: {error}")
        if mesh is not None:
            check_spec_fits(spec, np.shape(x), mesh, what=f"batch_spec of leaf {_path_str(path)}")
    return batch_size, specs


def check_batch_spec_has_mesh(batch_spec: Any, mesh: Mesh | None) -> None:
    """ValueError when a batch spec is given without the mesh it refers to (it would be
    ignored)."""
    if batch_spec is not None and mesh is None:
        raise ValueError(
            f"batch_spec={batch_spec} needs mesh=...: pass the mesh the spec refers to (e.g. "
            "trn_accum.build_mesh({'data': -1})) or drop batch_spec"
        )


# ----------------------------------------------------------------------------- split / merge


def manual_axes() -> frozenset[str]:
    """Mesh axes that are Manual where this is traced (inside a `jax.shard_map` body)."""
    am = jax.sharding.get_abstract_mesh()
    types = getattr(am, "axis_types", ()) or ()
    return frozenset(n for n, t in zip(am.axis_names, types, strict=False) if t == AxisType.Manual)


def _varying_axes(a: jax.Array) -> frozenset[str]:
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10; `vma` before
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like(x: Any, *like: jax.Array) -> Any:
    """`x` (a pytree) marked as varying over every manual axis any of `like` varies over, so a
    loop carry built from constants has the type its body returns inside `jax.shard_map`."""
    axes = tuple(sorted(set().union(*(_varying_axes(a) for a in like))))
    if not axes:
        return x
    return jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), x)


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


def split_leaf(x: jax.Array, steps: int, mesh: Mesh | None, spec: P) -> jax.Array:
    """One leaf [B, *rest] -> [k, B/k, *rest] (rows i::k), constrained to `spec` before and to
    P(None, *spec) after (no validation: `split_minibatches` validates)."""
    x = constrain(x, mesh, spec)
    b, rest = x.shape[0], x.shape[1:]
    y = x.reshape(b // steps, steps, *rest).swapaxes(0, 1)
    return constrain(y, mesh, P(None, *spec))


def split_minibatches(
    batch: Any, steps: int, *, mesh: Mesh | None = None, batch_spec: Any = None
) -> Any:
    """Strided split of every leaf: [B, *rest] -> [k, B/k, *rest]; minibatch i = rows i::k.

    With `mesh`, the input is constrained to its spec and the stack to P(None, *spec) (every
    device keeps exactly its rows: no collective). Without `mesh`, the same math and no
    constraints. Raises ValueError as `validate_batch` does.
    """
    steps = validate_steps(steps)
    _, specs = validate_batch(batch, steps, mesh=mesh, batch_spec=batch_spec)
    leaves, treedef = jax.tree.flatten(batch)
    out = [split_leaf(x, steps, mesh, s) for x, s in zip(leaves, specs, strict=True)]
    return jax.tree.unflatten(treedef, out)


def merge_minibatches(stacked: Any, *, mesh: Mesh | None = None, batch_spec: Any = None) -> Any:
    """Exact inverse of `split_minibatches`: [k, B/k, *rest] -> [B, *rest] in the original row
    order (row j·k + i = stacked[i, j]). With `mesh`, the result is constrained to the spec."""
    check_batch_spec_has_mesh(batch_spec, mesh)
    leaves, treedef = jax.tree.flatten(stacked)
    for path, x in jax.tree.flatten_with_path(stacked)[0]:
        if np.ndim(x) < 2:
            raise ValueError(
                f"stacked leaf {_path_str(path)} has shape {np.shape(x)}; merge_minibatches "
                "needs [k, B/k, ...] (rank >= 2)"
            )
    specs = (
        leaf_specs(jax.tree.map(lambda x: x[0], stacked), batch_spec)
        if mesh is not None
        else [None] * len(leaves)
    )
    out = []
    for x, spec in zip(leaves, specs, strict=True):
        k, bk, rest = x.shape[0], x.shape[1], x.shape[2:]
        if mesh is not None:
            check_spec_axes(spec, mesh)
            x = constrain(x, mesh, P(None, *spec))
        y = x.swapaxes(0, 1).reshape(k * bk, *rest)
        out.append(constrain(y, mesh, spec) if mesh is not None else y)
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- mesh


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
