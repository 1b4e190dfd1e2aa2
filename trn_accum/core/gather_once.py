"""gather="once": FSDP weights gathered once per step and kept for the k minibatches.

Under reduce="once" the minibatch loop runs inside a `shard_map` manual over the batch axes
(`reduce_once`). With gather="per_minibatch" (the default) the axes that also shard parameters
(FSDP: "fsdp") stay automatic, and XLA's partitioner all-gathers every weight inside every
minibatch (forward, and again in the backward of a rematerialised layer) and reduces every
minibatch's weight gradient over them. With gather="once" those axes are manual too:

    w_local = w's shard; w_full = all_gather(w_local.astype(gather_dtype), fsdp)  # once
    for i in range(k): g_i = grad(loss)(w_full, minibatch i on this device)      # local rows
      "once":           acc += psum_scatter(g_i, fsdp)   # reduce-scattered per minibatch
      "once_unsharded": acc += g_i                       # full-size float32 accumulator
    "once_unsharded": acc = psum_scatter(acc, fsdp)      # one reduce-scatter per step
    acc = psum(acc, data)                                # as reduce="once" does

Numbers: the same sums in another order (float32), so the same gradients within float32
rounding. With `gather_dtype` the weights travel in it (cast on the shard; bf16 halves the
bytes) and are cast back after the gather: exact when `loss_fn` casts those weights to that
dtype itself (a bf16 compute model). Memory per device: the gathered weights (full along the
gathered axes: the `gather_dtype` buffer and its cast back); one minibatch's gradient at that
full size; "once_unsharded" also a float32 accumulator of that size instead of the shard.

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trn_accum.core.constraints import manual_axes, varying_axes
from trn_accum.core.specs import spec_axes

__all__ = [
    "Gather",
    "gather",
    "gather_manual",
    "plan",
    "scatter",
    "scatter_fn",
    "shard_spec",
    "tie_backward",
    "to_varying",
]

#: One leaf's gathered dimensions: ((dim, (mesh axes...)), ...); () = nothing gathered.
Gather = tuple[tuple[int, tuple[str, ...]], ...]


def plan(
    grad_shardings: Sequence | None, n_leaves: int, manual: Sequence[str], on: bool = True
) -> list[Gather] | None:
    """Per parameter leaf (`leaf_shardings` order), the dimensions its spec shards over the
    manual axes `manual`: those are all-gathered before the loop. None when not `on` or no
    axis is manual (gather="per_minibatch")."""
    if not on or not manual:
        return None
    if grad_shardings is None:
        return [()] * n_leaves
    out = []
    for ms in grad_shardings:
        dims = []
        for d, entry in enumerate(() if ms is None else ms[1]):
            axes = tuple(a for a in spec_axes(entry) if a in manual)
            if axes:
                dims.append((d, axes))
        out.append(tuple(dims))
    return out


def shard_spec(g: Gather, ndim: int) -> P:
    """The shard_map in/out spec of a leaf: split over its gathered axes only."""
    entries: list[Any] = [None] * ndim
    for d, axes in g:
        entries[d] = axes[0] if len(axes) == 1 else axes
    return P(*entries)


def to_varying(x: jax.Array, manual: Sequence[str]) -> jax.Array:
    """`x` marked varying over every axis of `manual` it is not varying over yet (per-device
    partial sums stay local until the one reduction after the loop)."""
    have = varying_axes(x)
    missing = tuple(a for a in manual if a not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def gather(x: jax.Array, g: Gather, dtype: Any) -> jax.Array:
    """One leaf's shard -> full along its gathered dimensions (tiled all-gathers). With
    `dtype` (and `x` floating) the shard is cast to it for the transfer and the result cast
    back to x's dtype: the loss gets x's dtype holding `dtype`'s values, so each of its own
    casts to `dtype` is exact and their gradients still add up in x's dtype (a bf16 gathered
    weight used twice, like a tied embedding, would sum its cotangents in bf16)."""
    if not g:
        return x
    home = x.dtype
    narrow = dtype is not None and jnp.issubdtype(home, jnp.floating)
    if narrow:
        x = x.astype(dtype)
    for d, axes in g:
        x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=d, tiled=True)
    return x.astype(home) if narrow else x


def gather_manual(x: jax.Array, g: Gather, spec: P | None = None) -> jax.Array:
    """`gather(x, g, None)` manual over every mesh axis: inside a `shard_map` over the axes
    still automatic (x split there as `spec`, a PartitionSpec naming only those; None =
    whole), so its transpose is a reduce-scatter in x's dtype on the local blocks. Left to the
    partitioner in a region manual over some axes only, the collectives' operands were
    gathered over the automatic ones ("model" on fsdp 4 x model 2), and XLA:CPU's
    `all-reduce-promotion` aborts on a bf16 reduce-scatter there (its reducer carries a
    sharding constraint); fully manual, neither happens."""
    if not g:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    auto = set() if mesh.empty else set(mesh.axis_names) - set(manual_axes())
    if not auto:
        return gather(x, g, None)
    spec = P() if spec is None else spec
    return jax.shard_map(
        lambda a: gather(a, g, None), in_specs=spec, out_specs=spec, axis_names=auto
    )(x)


def tie_backward(x, tree, x_spec: P | None = None, specs=None):
    """(x, tree) unchanged. In the backward pass x's cotangent is made to depend on every
    cotangent of `tree` (a layer's weight shards: their reduce-scattered gradients), so what
    consumes it (the previous layer's backward) runs after them: the scheduler cannot defer a
    layer's weight gradients and keep their full-size inputs alive meanwhile. The dependency is
    data (0 x one element of each, added per device to x's cotangent): XLA:CPU drops
    optimization barriers before it schedules. `x_spec` and `specs` (a PartitionSpec per leaf
    of `tree`): how they are split over the mesh axes still automatic (None: whole). Numbers:
    the same while those first elements are finite (else x's cotangent turns NaN there)."""

    @jax.custom_vjp
    def tie(x, tree):
        return x, tree

    def fwd(x, tree):
        return (x, tree), None

    def bwd(_, cotangents):
        gx, gtree = cotangents
        return _after(gx, jax.tree.leaves(gtree), x_spec, specs), gtree

    tie.defvjp(fwd, bwd)
    return tie(x, tree)


def _after(gx, leaves, x_spec, specs):
    """gx + 0 x (the first element of each of `leaves`), computed on each device's blocks."""

    def local(gx, *leaves):
        probe = sum(jnp.ravel(g)[0].astype(jnp.float32) for g in leaves)
        return gx + (probe * 0).astype(gx.dtype)

    mesh = jax.sharding.get_abstract_mesh()
    auto = set() if mesh.empty else set(mesh.axis_names) - set(manual_axes())
    if not auto or x_spec is None:
        return local(gx, *leaves)
    in_specs = (x_spec, *jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))
    out = jax.shard_map(
        local, in_specs=in_specs, out_specs=x_spec, axis_names=auto, check_vma=False
    )(gx, *leaves)
    return to_varying(out, tuple(varying_axes(gx)))  # unchecked above: gx's type again


def scatter(x: jax.Array, g: Gather) -> jax.Array:
    """A full-size (per-device partial) gradient -> this device's shard, summed over the
    gathered axes (a tiled reduce-scatter per gathered dimension)."""
    for d, axes in g:
        x = jax.lax.psum_scatter(
            x, axes if len(axes) > 1 else axes[0], scatter_dimension=d, tiled=True
        )
    return x


def scatter_fn(gathers: list[Gather] | None, mode: str):
    """gather="once": the function taking a weighted minibatch gradient tree (full-size) to
    the shards, for `Accumulator.add`; None otherwise ("once_unsharded" scatters after the
    loop, `reduce_once.psum_grads`)."""
    if gathers is None or mode != "once":
        return None

    def scatter_tree(tree):
        leaves, treedef = jax.tree.flatten(tree)
        out = [scatter(g, s) for g, s in zip(leaves, gathers, strict=True)]
        return jax.tree.unflatten(treedef, out)

    return scatter_tree
