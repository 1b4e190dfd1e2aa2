"""The strided split of a sharded batch into k minibatches, and its inverse.

A global batch of B rows sharded on axis 0 over D devices (device d holds rows
[d·B/D, (d+1)·B/D)) is split into k minibatches *strided*: minibatch i = rows i, i+k, i+2k, ...

    stacked = x.reshape(B/k, k, *rest).swapaxes(0, 1)        # [k, B/k, *rest]

Row r = j·k + i lands at stacked[i, j]; device d's rows are j in [d·B/(k·D), (d+1)·B/(k·D)) for
every i, i.e. rows it already holds. So the stacked array's sharding is P(None, *batch_spec) and
each minibatch's is batch_spec, computable from the PartitionSpec alone, and the split moves no
data (a contiguous split, rows [i·B/k, (i+1)·B/k), would put minibatch 0 on the first D/k
devices). Requirement: B divisible by k·D (`batch_rules`). Non-batch axes keep their sharding.

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.core.batch_rules import check_batch_spec_has_mesh, validate_batch, validate_steps
from trn_accum.core.constraints import constrain
from trn_accum.core.specs import as_spec, check_spec_axes, is_spec, leaf_specs, path_str

__all__ = ["merge_minibatches", "minibatch_specs", "split_leaf", "split_minibatches"]


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
                f"stacked leaf {path_str(path)} has shape {np.shape(x)}; merge_minibatches "
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
