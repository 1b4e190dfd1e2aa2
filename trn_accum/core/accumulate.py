"""Gradient accumulation with a static, communication-free minibatch layout.

`accumulate_gradients(loss_fn, steps=k, ...)` returns `grad_fn(params, batch, *args)` that
gives what `jax.value_and_grad(loss_fn, has_aux=...)(params, batch, *args)` gives on the full
batch, computed over k strided minibatches (see `trn_accum.core.sharding`):

    check specs against shapes                   # ValueErrors with the numbers, before tracing
    stacked = split_minibatches(batch, k)        # [k, B/k, ...], sharded P(None, *batch_spec)
    for i in range(k):                           # lax.scan (default) or a Python loop
        (L_i, aux_i), g_i = value_and_grad(loss_fn)(params, stacked[i], *args_i)
        w_i = weight_fn(stacked[i])              # e.g. number of real target tokens
        acc += where(w_i != 0, w_i * g_i, 0)     # float32, constrained to param_specs
    loss, grads = Σ w_i L_i / Σ w_i, Σ w_i g_i / Σ w_i          (0 and 0 when Σ w_i = 0)

Exactness: for a loss that is a weighted mean over its batch with weight w_i per minibatch, the
full-batch loss is Σ w_i L_i / Σ w_i, and so are the gradients; a mean of minibatch means is
wrong when the w_i differ. Zero-weight minibatches are dropped by selection (`jnp.where`), not by
multiplication, so a NaN loss of an all-padding minibatch (0/0) does not leak (0 * NaN = NaN).
The carry and the aux reductions live in `accumulator`; `reduce="once"` in `reduce_once`.

Everything it emits is static: a fixed-length `lax.scan` or straight-line code, no `lax.cond`,
no host callbacks, no data-dependent loop bounds (Neuron constraints).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.core import reduce_once as once
from trn_accum.core import rng
from trn_accum.core import sharding as shd
from trn_accum.core.accumulator import Accumulator, all_finite
from trn_accum.core.reductions import (
    AUX_REDUCTIONS,
    AuxReductionWarning,
    check_aux_reduction,
    choose_reductions,
)

__all__ = ["AUX_REDUCTIONS", "LOOPS", "REDUCES", "AuxReductionWarning", "accumulate_gradients"]

LOOPS = ("scan", "unroll")
REDUCES = ("per_minibatch", "once")


@dataclasses.dataclass(frozen=True)
class _Options:
    loss_fn: Callable
    steps: int
    mesh: Mesh | None
    batch_spec: Any
    param_specs: Any
    weight_fn: Callable | None
    aux_reduction: Any
    has_aux: bool
    rng_argnums: tuple[int, ...]
    grad_dtype: Any
    loop: str
    reduce: str
    skip_nonfinite: bool


def accumulate_gradients(
    loss_fn: Callable,
    *,
    steps: int,
    mesh: Mesh | None = None,
    batch_spec: Any = None,
    param_specs: Any = None,
    weight_fn: Callable | None = None,
    aux_reduction: Any = None,
    has_aux: bool = False,
    rng_argnum: int | tuple[int, ...] | None = None,
    grad_dtype: Any = None,
    loop: str = "scan",
    reduce: str = "per_minibatch",
    skip_nonfinite: bool = False,
) -> Callable:
    """Wrap `loss_fn(params, batch, *args)` into `grad_fn(params, batch, *args)` that returns
    `(loss, grads)` (or `((loss, aux), grads)` with `has_aux`) as `jax.value_and_grad` does on
    the full batch, accumulated over `steps` strided minibatches.

    Args:
      loss_fn: returns the (weighted) mean loss over the batch it is given, a scalar, or
        `(loss, aux)` when `has_aux`.
      steps: k, number of minibatches (static int >= 1). B must be divisible by k × the shard
        count of the batch axes in `batch_spec`.
      mesh, batch_spec: the mesh and the PartitionSpec of the batch leaves (one spec for all
        leaves, cut to each leaf's rank, or a pytree of specs). The stack [k, B/k, ...] is
        constrained to P(None, *spec) and every minibatch [B/k, ...] to spec. `mesh=None`:
        same math, no constraints (a `batch_spec` without `mesh` is a ValueError).
      param_specs: PartitionSpecs (or NamedShardings) of the parameters, a pytree prefix of
        `params` (None: no constraint); the float32 accumulator and each minibatch gradient
        are constrained to them. None leaves and empty subtrees of `params` (`eqx.partition`'s)
        get no gradient and no constraint, as in `jax.tree` functions. A spec that does not fit
        its parameter (missing axis, dimension not divisible by the axis sizes) is a ValueError.
      weight_fn: `weight_fn(minibatch) -> scalar` weight w_i (e.g. the number of real target
        tokens); None = equal weights. Weights should be >= 0; w_i == 0 drops minibatch i.
      aux_reduction: how aux leaves are combined over minibatches (see `accumulator`): one of
        "mean" (weighted like the loss), "sum", "max", "min", "concat" (per-example leaves
        stitched back in row order), for every leaf; or a dict/pytree naming a subset of aux
        ({"tokens": "sum"}; None = the default); or a callable `(key_path) -> str | None`.
        A name matching no aux leaf is a ValueError. Default: scalars -> "mean", warning with
        an `AuxReductionWarning` when k > 1 unless named; leaves whose axis 0 follows the batch
        size -> "concat"; a leaf whose axis 0 only equals B/k by coincidence -> ValueError.
      has_aux: `loss_fn` returns `(loss, aux)`.
      rng_argnum: index (or tuple of indices) into grad_fn's positional arguments (params = 0,
        batch = 1, so >= 2) of PRNG keys; minibatch i receives `jax.random.fold_in(key, i)`
        for each.
      grad_dtype: dtype of the returned gradients; None (default): each parameter's dtype, as
        `jax.value_and_grad` returns. Accumulation is float32 regardless.
      loop: "scan" (fixed-length `lax.scan`: memory of one minibatch) or "unroll" (a Python
        loop: every slice static, nothing stacked at a loop index). Same numbers.
      reduce: "per_minibatch" (default: XLA reduces every minibatch's gradient across devices)
        or "once": one psum after the loop over the pure data-parallel axes (`reduce_once`).
        "once" needs an explicit, row-additive `weight_fn`; it then gives the numbers of
        "per_minibatch" whenever those are the full batch's. Constraints inside `loss_fn` must
        use `trn_accum.constrain`. Random draws differ between the modes: under "once"
        `loss_fn` sees one device's rows of minibatch i, gets `fold_in(fold_in(key, i), j)`
        (j: its index on the manual axes) and draws bits for that shape.
      skip_nonfinite: drop, by selection (weight 0), every minibatch whose loss, weight or any
        gradient element is not finite: the rest give the full batch's numbers over their rows
        alone. grad_fn then returns `(value, grads, dropped)`, `dropped` an int32 count of the
        dropped loss_fn calls (minibatches; under "once" minibatch × device pieces, each piece
        judged on its own rows). All dropped: loss and grads NaN, as without the option.

    Returns:
      grad_fn(params, batch, *args); shapes are checked at trace time (ValueErrors name the
      leaf and the numbers). Called eagerly it runs as a `jax.jit` of itself (one compile per
      input signature; extra arguments must be arrays); inside a caller's trace, inline.
    """
    steps = shd.validate_steps(steps)
    for name, value, allowed in (("loop", loop, LOOPS), ("reduce", reduce, REDUCES)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    if reduce == "once":
        once.check_weight_fn(weight_fn)
    argnums = rng.check_rng_argnum(rng_argnum)
    shd.check_batch_spec_has_mesh(batch_spec, mesh)
    if mesh is not None:
        shd.check_auto_mesh(mesh)
        if shd.is_spec(batch_spec):
            shd.check_spec_axes(shd.as_spec(batch_spec), mesh)
    bare = jax.tree.leaves(param_specs, is_leaf=shd.is_sharding_leaf)
    if mesh is None and any(isinstance(s, P) for s in bare):
        raise ValueError(
            "param_specs given as PartitionSpecs needs mesh=...; pass the mesh or NamedShardings"
        )
    check_aux_reduction(aux_reduction)
    dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
    # fmt: off
    opts = _Options(loss_fn, steps, mesh, batch_spec, param_specs, weight_fn, aux_reduction,
                    bool(has_aux), argnums, dtype, loop, reduce, bool(skip_nonfinite))
    # fmt: on

    @jax.jit
    def compiled(params, batch, *args):
        return _accumulate(opts, params, batch, args)

    def grad_fn(params, batch, *args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, batch, args))):
            return _accumulate(opts, params, batch, args)  # in the caller's trace: inline
        return compiled(params, batch, *args)  # eager: jit's cache, one compile per signature

    grad_fn.__name__ = f"accumulated_{getattr(loss_fn, '__name__', 'loss')}"
    grad_fn.__doc__ = f"{steps}-step accumulated value_and_grad of {loss_fn!r}."
    return grad_fn


def _accumulate(opts: _Options, params: Any, batch: Any, args: tuple) -> Any:
    """validate -> strided split -> fixed-length loop -> exact weighted sum (traced)."""
    k, mesh = opts.steps, opts.mesh
    batch_size, specs = shd.validate_batch(batch, k, mesh=mesh, batch_spec=opts.batch_spec)
    rng.check_args(opts.rng_argnums, args)
    grad_shardings = shd.leaf_shardings(opts.param_specs, params, mesh, what="param_specs")
    manual = once.manual_axes_for(mesh, specs, grad_shardings) if opts.reduce == "once" else ()

    aux_shape = reductions = None
    if opts.has_aux:  # aux structure and reductions from shapes alone, before the loop

        def aux_at(rows: int) -> Any:
            shaped = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch
            )
            loss_aux = functools.partial(_loss_with_aux, opts)
            return jax.eval_shape(loss_aux, params, shaped, *_minibatch_args(opts, args, 0))[1]

        aux_shape = aux_at(batch_size // k)
        reductions = choose_reductions(
            opts.aux_reduction, aux_shape, batch_size // k, k, lambda: aux_at(batch_size)
        )
    acc = Accumulator(reductions, aux_shape, grad_shardings, opts.skip_nonfinite)
    example_spec = P(specs[0][0] if mesh is not None and len(specs[0]) else None)

    def local(params, batch, args, specs, vary):
        carry, stacked_aux, loss_dtype = _loop(opts, acc, params, batch, args, specs, vary)
        if vary:  # reduce="once": the one reduction, after the loop
            carry = once.psum_carry(carry, acc.reductions, vary)
        calls = k * int(np.prod([mesh.shape[a] for a in vary])) if opts.skip_nonfinite else None
        return acc.finish(carry, stacked_aux, loss_dtype, mesh, example_spec, calls)

    if manual:
        loss, aux, grads, dropped = once.run_manual(
            local,
            mesh=mesh,
            manual=manual,
            batch_specs=specs,
            reductions=reductions,
            params=params,
            batch=batch,
            args=args,
        )
    else:
        loss, aux, grads, dropped = local(params, batch, args, specs, ())

    dtype = opts.grad_dtype  # None: each parameter's (jnp.dtype objects are truthy)
    grads = jax.tree.map(lambda g, p: g.astype(dtype or jnp.result_type(p)), grads, params)
    grads = acc.constrain_grads(grads)
    value = (loss, aux) if opts.has_aux else loss
    return (value, grads, dropped) if opts.skip_nonfinite else (value, grads)


def _loss_with_aux(opts: _Options, p, mb, *a):
    out = opts.loss_fn(p, mb, *a)
    if not opts.has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(
            f"has_aux=True but loss_fn did not return a (loss, aux) pair: got {type(out).__name__}"
        )
    return out[0], out[1]


def _minibatch_args(opts: _Options, args: tuple, i, vary: tuple[str, ...] = ()) -> tuple:
    """args with each PRNG key of `rng_argnum` folded per minibatch (`rng.fold_keys`)."""
    return rng.fold_keys(opts.rng_argnums, args, i, vary)


def _loop(opts, acc, params, batch, args, specs, vary):
    """Run the k minibatches; returns (carry, stacked per-example aux, loss dtype).

    Shapes here are global, or per-device along the manual axes `vary` (reduce="once")."""
    k, mesh = opts.steps, opts.mesh
    leaves, treedef = jax.tree.flatten(batch)
    stacked = jax.tree.unflatten(
        treedef, [shd.split_leaf(x, k, mesh, s) for x, s in zip(leaves, specs, strict=True)]
    )
    vg = jax.value_and_grad(functools.partial(_loss_with_aux, opts), has_aux=True)
    loss_dtype = []  # filled while the body is traced

    def one_minibatch(mb, i):
        """(loss_i, aux_i, grads_i float32, w_i) of minibatch i; grads constrained."""
        mb = jax.tree.unflatten(
            treedef,
            [shd.constrain(x, mesh, s) for x, s in zip(jax.tree.leaves(mb), specs, strict=True)],
        )
        (loss_i, aux_i), g_i = vg(params, mb, *_minibatch_args(opts, args, i, vary))
        loss_dtype.append(jnp.result_type(loss_i))
        w_i = jnp.float32(1.0) if opts.weight_fn is None else opts.weight_fn(mb)
        w_i = jnp.asarray(w_i, jnp.float32)
        if np.shape(w_i) != ():
            raise ValueError(f"weight_fn must return a scalar, got shape {np.shape(w_i)}")
        g_i = acc.constrain_grads(jax.tree.map(lambda g: g.astype(jnp.float32), g_i))
        return (
            loss_i,
            aux_i,
            g_i,
            w_i,
            all_finite(loss_i, w_i, g_i) if opts.skip_nonfinite else None,
        )

    carry = acc.init(params)
    if vary:  # carries hold per-device partial sums
        carry = jax.tree.map(lambda x: jax.lax.pcast(x, vary, to="varying"), carry)
    if opts.loop == "scan":

        def body(carry, xs):
            mb, i = xs
            return acc.add(carry, *one_minibatch(mb, i))

        carry, stacked_aux = jax.lax.scan(body, carry, (stacked, jnp.arange(k)), length=k)
    else:
        pieces = []
        for i in range(k):
            mb = jax.tree.map(lambda x, i=i: x[i], stacked)
            carry, per_example = acc.add(carry, *one_minibatch(mb, i))
            pieces.append(per_example)
        stacked_aux = jax.tree.map(lambda *xs: jnp.stack(xs), *pieces)
    return carry, stacked_aux, loss_dtype[0]
