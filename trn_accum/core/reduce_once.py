"""reduce="once": the minibatch loop manual over the pure data-parallel axes, one psum after it.

    manual = leading batch axes that no parameter spec uses   # ("data",) on (data, fsdp)
    shard_map(loop, axis_names=manual):                       # fsdp, seq, model stay automatic
        each device: carry = Σ_i over its own rows of minibatch i (float32, local partial sums)
        carry = psum(carry, manual)                            # the one reduction, after the loop
        divide as per_minibatch does

With `reduce_dtype` (bfloat16) the gradients of that one psum (and gather="once_unsharded"'s
reduce-scatter) travel in it: each device's float32 sum is cast down before the collective and
the result cast back to float32 (half the bytes, bf16 rounding of the partial sums and of
their total); the loss, the weights, aux and the accumulation itself stay float32.

Numbers: with weights w_ij = weight_fn(device j's rows of minibatch i) and L_ij the loss of
those rows, "once" gives Σ_ij w_ij·L_ij / Σ_ij w_ij. That equals "per_minibatch"'s
Σ_i w_i·L_i / Σ_i w_i whenever the latter is the full batch's value: `weight_fn` additive over
rows (w_i = Σ_j w_ij, like a token count) and L_i the w-weighted mean of its rows. This is why
reduce="once" needs an explicit `weight_fn` (a masked mean under equal weights has no single
definition across the two modes).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.core import gather_once
from trn_accum.core.accumulator import Carry
from trn_accum.core.constraints import manual_axes
from trn_accum.core.specs import drop_axes, spec_axes

__all__ = [
    "check_weight_fn",
    "manual_axes_for",
    "psum_carry",
    "psum_grads",
    "psum_grads_narrow",
    "run_manual",
]


def check_weight_fn(weight_fn: Callable | None, reduce: str = "once") -> None:
    """ValueError unless reduce="once" has an explicit weight_fn (see the module docstring)."""
    if weight_fn is None and reduce == "once":
        raise ValueError(
            'reduce="once" needs an explicit weight_fn, additive over rows, so that it gives '
            "the numbers of per_minibatch: e.g. weight_fn=lambda mb: mb['mask'].sum() for a "
            "masked mean, or lambda mb: mb['x'].shape[0] for a plain mean over rows"
        )


def manual_axes_for(
    mesh: Mesh | None,
    batch_specs: list[P],
    grad_shardings: list | None,
    fsdp: bool = False,
    on: bool = True,
):
    """The pure data-parallel axes: the leading mesh axes of the batch dimension's sharding
    (the same for every batch leaf) up to the first one a parameter spec uses (all of them with
    `fsdp`: gather="once" makes the FSDP axes manual too, `gather_once`), leaving out
    axes of size 1 (nothing to reduce over them; XLA's partitioner also rejects an all-reduce
    manual over only size-1 axes). () without a mesh, when not `on` (reduce="per_minibatch")
    or when no axis remains: then "once" is "per_minibatch"."""
    if mesh is None or not on:
        return ()
    entries = {tuple(spec_axes(s[0])) if len(s) else () for s in batch_specs}
    if len(entries) != 1:
        raise ValueError(
            f'reduce="once" needs every batch leaf sharded the same way on axis 0, got {entries}'
        )
    used = {
        axis
        for ms in grad_shardings or ()
        if ms is not None
        for entry in ms[1]
        for axis in spec_axes(entry)
    }
    manual = []
    for axis in next(iter(entries)):
        if axis in used and not fsdp:
            break
        if mesh.shape[axis] > 1:
            manual.append(axis)
    return tuple(manual)


def psum_grads(grads: Any, axes: tuple[str, ...], gathers=None, scatter: bool = False) -> Any:
    """The gradient sums over `axes`; with `gathers` (gather="once", one `gather_once.Gather`
    per leaf) a gathered leaf is first reduce-scattered over its gathered axes when `scatter`
    (its carry is full-size: "once_unsharded"; "once" scattered every minibatch) and then
    psum'd over the other axes only. One psum per distinct axis set."""
    if gathers is None:
        return jax.lax.psum(grads, axes)
    leaves, treedef = jax.tree.flatten(grads)
    out: list[Any] = list(leaves)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (x, g) in enumerate(zip(leaves, gathers, strict=True)):
        if scatter:
            out[i] = gather_once.scatter(x, g)
        done = {a for _, ax in g for a in ax}
        groups.setdefault(tuple(a for a in axes if a not in done), []).append(i)
    for rest, idx in groups.items():
        if rest:
            summed = jax.lax.psum([out[i] for i in idx], rest)
            for i, v in zip(idx, summed, strict=True):
                out[i] = v
    return jax.tree.unflatten(treedef, out)


def psum_grads_narrow(
    grads: Any,
    axes: tuple[str, ...],
    dtype: Any,
    grad_shardings=None,
    gathers=None,
    scatter: bool = False,
) -> Any:
    """`psum_grads` with every leaf cast to `dtype` before its collectives and back to its own
    dtype after them. The collectives run in a `shard_map` manual over the mesh's other
    (automatic) axes too, each leaf split as its `grad_shardings` spec says there (a gathered
    dimension whole): inside a partially manual region JAX writes a sharding constraint into a
    collective's reducer, on which XLA:CPU's `all-reduce-promotion` (it widens bf16 reductions
    to float32) aborts ("Invalid binary instruction opcode copy"); fully manual, it writes none.
    """

    def reduce(tree):
        narrow = psum_grads(jax.tree.map(lambda x: x.astype(dtype), tree), axes, gathers, scatter)
        return jax.tree.map(lambda y, x: y.astype(x.dtype), narrow, tree)

    manual = manual_axes()
    auto = {a for a in jax.sharding.get_abstract_mesh().axis_names if a not in manual}
    if not auto:
        return reduce(grads)
    leaves, treedef = jax.tree.flatten(grads)
    specs = []
    for i, x in enumerate(leaves):
        ms = grad_shardings[i] if grad_shardings is not None else None
        entries = list(drop_axes(None if ms is None else ms[1], manual))
        for d, _ in gathers[i] if gathers is not None else ():
            entries[d] = None  # scattered over manual axes inside: auto axes kept off it
        specs.append(P(*entries[: jnp.ndim(x)]))
    tree_specs = jax.tree.unflatten(treedef, specs)
    return jax.shard_map(reduce, in_specs=(tree_specs,), out_specs=tree_specs, axis_names=auto)(
        grads
    )


def psum_carry(
    carry: Carry,
    reductions: list[str],
    axes: tuple[str, ...],
    gathers=None,
    gather: str = "",
    dtype: Any = None,
    grad_shardings=None,
) -> Carry:
    """The one reduction after the loop: sums (and the dropped count) psum'd, "max"/"min" aux
    pmax/pmin'd over `axes` ("concat" aux is per device already: the shard_map's out_specs
    stitch it; a "weighted" carry is a pair of sums); gradients by `psum_grads` (`gather`: the
    gather mode, "once_unsharded" reduce-scatters the full-size gradients here); with `dtype`
    (bfloat16; None = float32) by `psum_grads_narrow` in it (`grad_shardings`: their specs)."""

    def reduce(red: str, x):
        if red == "max":
            return jax.lax.pmax(x, axes)
        if red == "min":
            return jax.lax.pmin(x, axes)
        return x if red == "concat" else jax.lax.psum(x, axes)

    if gathers is None and dtype is None:  # one all-reduce for the sums and the gradients
        sums = (carry.loss, carry.weight, carry.grads, carry.dropped)
        loss, weight, grads, dropped = jax.lax.psum(sums, axes)
    else:
        loss, weight, dropped = jax.lax.psum((carry.loss, carry.weight, carry.dropped), axes)
        scatter = gather == "once_unsharded"
        if dtype is None:
            grads = psum_grads(carry.grads, axes, gathers, scatter)
        else:
            grads = psum_grads_narrow(carry.grads, axes, dtype, grad_shardings, gathers, scatter)
    aux = [reduce(red, x) for red, x in zip(reductions, carry.aux, strict=True)]
    return Carry(loss, weight, grads, aux, dropped)


def run_manual(
    local: Callable,
    *,
    mesh: Mesh,
    manual: tuple[str, ...],
    batch_specs: list[P],
    reductions: Any,
    params: Any,
    batch: Any,
    args: tuple,
    gathers: list | None = None,
    gather_dtype: Any = None,
    in_loss: bool = False,
) -> tuple:
    """`local(params, batch, args, inner_specs, manual)` -> (loss, aux, grads, dropped) in a
    `shard_map` manual over `manual` only. Batch leaves enter split over the manual axes
    (per device [B/J, ...] with J their size), parameters and extra arguments replicated over
    them and cast to varying (so their gradients stay per-device partial sums); `inner_specs`
    are the batch specs without the manual axes. Outputs: loss, grads, the dropped count and
    reduced aux replicated; per-example aux stitched over the manual axes. With `gathers`
    (gather="once"): a parameter sharded over manual axes enters as its shard, is gathered
    (`gather_once`) and `local` also gets the shards (`shards=`); its gradient leaves sharded
    the same way. With `in_loss` (gather="in_loss") `local` gets the shards as the parameters
    (loss_fn gathers them where it uses them)."""
    entry = manual[0] if len(manual) == 1 else tuple(manual)
    inner_specs = [drop_axes(s, manual) for s in batch_specs]
    b_leaves, b_def = jax.tree.flatten(batch)
    batch_in = jax.tree.unflatten(b_def, [P(entry)] * len(b_leaves))
    aux_out = (
        None
        if reductions is None
        else jax.tree.map(lambda r: P(entry) if r == "concat" else P(), reductions)
    )

    p_leaves, p_def = jax.tree.flatten(params)
    if gathers is None:
        p_specs: Any = P()
    else:
        specs = [
            gather_once.shard_spec(g, jnp.ndim(x)) for x, g in zip(p_leaves, gathers, strict=True)
        ]
        p_specs = jax.tree.unflatten(p_def, specs)

    def body(params, batch, *args):
        if gathers is None:
            params = jax.tree.map(lambda p: jax.lax.pcast(p, manual, to="varying"), params)
            return local(params, batch, args, inner_specs, manual)
        shards = [gather_once.to_varying(x, manual) for x in jax.tree.leaves(params)]
        if in_loss:
            return local(jax.tree.unflatten(p_def, shards), batch, args, inner_specs, manual)
        full = [
            gather_once.to_varying(gather_once.gather(x, g, gather_dtype), manual)
            for x, g in zip(shards, gathers, strict=True)
        ]
        return local(
            jax.tree.unflatten(p_def, full),
            batch,
            args,
            inner_specs,
            manual,
            shards=jax.tree.unflatten(p_def, shards),
        )

    try:
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(p_specs, batch_in, *([P()] * len(args))),
            out_specs=(P(), aux_out, p_specs, P()),
            axis_names=set(manual),
        )(params, batch, *args)
    except ValueError as e:
        if "manual_axis_type" not in str(e):
            raise
        raise ValueError(
            f'reduce="once" runs loss_fn manual over mesh axes {manual}: a sharding constraint '
            "inside loss_fn names them or uses the concrete mesh; use "
            "trn_accum.constrain(x, mesh, spec), which drops manual axes "
            f"(JAX said: {str(e).splitlines()[0]})"
        ) from e
