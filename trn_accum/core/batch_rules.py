"""The batch rules: k (`steps`) is a static int >= 1, and B divides by k × the batch shards.

`valid_steps` is the one statement of the divisibility rule; `divisibility_error` words it with
the nearest valid k; `validate_batch` checks a whole batch (leaves, B, specs) before tracing
the split. Messages name the leaf, the numbers and a fix.

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.core.mesh import check_auto_mesh
from trn_accum.core.specs import (
    batch_shard_count,
    check_spec_axes,
    check_spec_fits,
    leaf_specs,
    path_str,
    spec_axes,
)

__all__ = [
    "check_batch_spec_has_mesh",
    "divisibility_error",
    "nearest_valid_steps",
    "valid_steps",
    "validate_batch",
    "validate_steps",
]


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


def check_batch_spec_has_mesh(batch_spec: Any, mesh: Mesh | None) -> None:
    """ValueError when a batch spec is given without the mesh it refers to (it would be
    ignored)."""
    if batch_spec is not None and mesh is None:
        raise ValueError(
            f"batch_spec={batch_spec} needs mesh=...: pass the mesh the spec refers to (e.g. "
            "trn_accum.build_mesh({'data': -1})) or drop batch_spec"
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
                f"batch leaf {path_str(path)} is a scalar; every batch leaf needs the batch "
                "size on axis 0 (pass scalars as extra arguments instead)"
            )
        sizes.setdefault(int(np.shape(x)[0]), []).append(path_str(path))
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
            raise ValueError(f"batch leaf {path_str(path)}: {error}")
        if mesh is not None:
            check_spec_fits(spec, np.shape(x), mesh, what=f"batch_spec of leaf {path_str(path)}")
    return batch_size, specs
