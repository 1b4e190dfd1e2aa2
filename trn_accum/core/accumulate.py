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
The carry lives in `accumulator`, the aux reductions in `reductions` (`WeightedScalar`:
`summaries`), `reduce="once"` in `reduce_once`, the threaded state (`state_argnum`) in `state`.

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

from trn_accum.core import gather_once, mesh_types, rng
from trn_accum.core import reduce_once as once
from trn_accum.core import sharding as shd
from trn_accum.core import state as st
from trn_accum.core.accumulator import Accumulator, all_finite, minibatch_weight
from trn_accum.core.reductions import AUX_REDUCTIONS, AuxReductionWarning, check_aux_reduction

__all__ = ["AUX_REDUCTIONS", "GATHERS", "LOOPS", "REDUCES", "REDUCE_DTYPES", "AuxReductionWarning",
           "accumulate_gradients"]  # fmt: skip

GATHERS = gather_once.GATHERS
LOOPS = ("scan", "unroll")
REDUCES = ("per_minibatch", "once")
REDUCE_DTYPES = ("float32", "bfloat16")  # reduce="once"'s cross-replica gradient reduction


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
    state_argnum: int | None
    gather: tuple  # (mode, dtype): `gather_once`
    reduce_dtype: Any  # None (float32) or bfloat16: `reduce_once.psum_grads_narrow`


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
    state_argnum: int | None = None,
    gather: str = "per_minibatch",
    gather_dtype: Any = None,
    reduce_dtype: str = "float32",
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
      aux_reduction: how aux leaves combine (`reductions`): "mean" (weighted like the loss),
        "sum", "max", "min" or "concat" (per-example, stitched in row order) for every leaf; a
        dict/pytree naming a subset ({"tokens": "sum"}); or a callable `(key_path) -> str |
        None`. Default: scalars "mean" (an `AuxReductionWarning` when k > 1), per-example
        leaves "concat". `WeightedScalar` nodes combine by their own weights, unnamed.
      has_aux: `loss_fn` returns `(loss, aux)`.
      rng_argnum: index or tuple of indices (>= 2: params = 0, batch = 1) of grad_fn's PRNG
        key arguments; minibatch i receives `jax.random.fold_in(key, i)` for each.
      grad_dtype: dtype of the returned gradients; None (default): each parameter's dtype, as
        `jax.value_and_grad` returns. Accumulation is float32 regardless.
      loop: "scan" (fixed-length `lax.scan`: memory of one minibatch) or "unroll" (a Python
        loop: every slice static, nothing stacked at a loop index). Same numbers.
      reduce: "per_minibatch" (default: XLA reduces every minibatch's gradient across devices)
        or "once": one psum after the loop over the pure data-parallel axes (`reduce_once`).
        "once" needs an explicit, row-additive `weight_fn` (then it gives "per_minibatch"'s
        numbers) and `trn_accum.constrain` inside `loss_fn`; `loss_fn` sees one device's rows
        of minibatch i and its keys get `fold_in(fold_in(key, i), j)` (j: the device index).
      skip_nonfinite: drop, by selection (weight 0), every minibatch whose loss, weight or any
        gradient element is not finite: the rest give the full batch's numbers over their rows
        alone. grad_fn then returns `(value, grads, dropped)`, `dropped` an int32 count of the
        dropped loss_fn calls (minibatches; under "once" minibatch × device pieces, each piece
        judged on its own rows). All dropped: loss and grads NaN, as without the option.
      state_argnum: index (>= 2) of a non-parameter state argument (batch statistics, NNX
        `Rngs` counters) threaded through the minibatches in order (`core/state.py`): loss_fn
        returns `(loss, (aux, new_state))`, minibatch i gets minibatch i-1's new state, and
        grad_fn returns `((loss, (aux, final_state)), grads)`. Needs has_aux, per_minibatch.
      gather, gather_dtype: under reduce="once", FSDP weights gathered per minibatch (default),
        "once" or "once_unsharded" per step, travelling in gather_dtype (`gather_once`).
      reduce_dtype: under reduce="once", the dtype the accumulated gradients cross replicas in:
        "float32" (default) or "bfloat16" (each device's float32 sum cast down before the one
        psum after the loop, and gather="once_unsharded"'s reduce-scatter, and back after): it
        halves the bytes that reduction moves, at bf16 rounding (2^-9). Accumulation: float32.

    Returns:
      grad_fn(params, batch, *args); shapes are checked at trace time (ValueErrors name the
      leaf and the numbers). Called eagerly it runs as a `jax.jit` of itself (one compile per
      input signature; extra arguments must be arrays); inside a caller's trace, inline.
    """
    steps = shd.validate_steps(steps)
    choices = (("loop", loop, LOOPS), ("reduce", reduce, REDUCES), ("gather", gather, GATHERS),
               ("reduce_dtype", reduce_dtype, REDUCE_DTYPES))  # fmt: skip
    for name, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    gather_once.check_reduce(gather, reduce)
    once.check_reduce_dtype(reduce_dtype, reduce)
    once.check_weight_fn(weight_fn, reduce)
    argnums = rng.check_rng_argnum(rng_argnum)
    state_argnum = st.check_state_argnum(state_argnum, argnums, has_aux, reduce)
    shd.check_batch_spec_has_mesh(batch_spec, mesh)
    mesh = mesh_types.auto_mesh(mesh)  # any axis types: the same devices with Auto axes
    if mesh is not None and shd.is_spec(batch_spec):
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
                    bool(has_aux), argnums, dtype, loop, reduce, bool(skip_nonfinite),
                    state_argnum, (gather, gather_dtype and jnp.dtype(gather_dtype)),
                    None if reduce_dtype == "float32" else jnp.dtype(reduce_dtype))
    # fmt: on

    @jax.jit
    def compiled(params, batch, *args):
        return _accumulate(opts, params, batch, args)

    grad_fn = mesh_types.on_auto_mesh(
        compiled, lambda params, batch, *args: _accumulate(opts, params, batch, args), mesh
    )
    grad_fn.__name__ = f"accumulated_{getattr(loss_fn, '__name__', 'loss')}"
    grad_fn.__doc__ = f"{steps}-step accumulated value_and_grad of {loss_fn!r}."
    return grad_fn


def _accumulate(opts: _Options, params: Any, batch: Any, args: tuple) -> Any:
    """validate -> strided split -> fixed-length loop -> exact weighted sum (traced)."""
    k, mesh = opts.steps, opts.mesh
    batch_size, specs = shd.validate_batch(batch, k, mesh=mesh, batch_spec=opts.batch_spec)
    rng.check_args(opts.rng_argnums, args)
    grad_shardings = shd.leaf_shardings(opts.param_specs, params, mesh, what="param_specs")
    fsdp = opts.gather[0] != "per_minibatch"  # gather="once": the FSDP axes manual too
    manual = once.manual_axes_for(mesh, specs, grad_shardings, fsdp, opts.reduce == "once")
    gathers = gather_once.plan(grad_shardings, len(jax.tree.leaves(params)), manual, fsdp)
    aux_shape, reductions = st.plan_outputs(
        functools.partial(_loss_with_aux, opts), opts, params, batch, args, batch_size
    )
    acc = Accumulator(reductions, aux_shape, grad_shardings, opts.skip_nonfinite)
    example_spec = P(specs[0][0] if mesh is not None and len(specs[0]) else None)

    def local(params, batch, args, specs, vary, shards=None):
        out = _loop(opts, acc, params, batch, args, specs, vary, gathers, shards)
        carry, stacked_aux, loss_dtype, state = out
        if vary:  # reduce="once": the one reduction, after the loop
            carry = once.psum_carry(carry, acc.reductions, vary, gathers, opts.gather[0],
                                    opts.reduce_dtype, grad_shardings)  # fmt: skip
        calls = k * int(np.prod([mesh.shape[a] for a in vary])) if opts.skip_nonfinite else None
        return acc.finish(carry, stacked_aux, loss_dtype, mesh, example_spec, calls), state

    if manual:  # state_argnum is per_minibatch only: no state
        # fmt: off
        (loss, aux, grads, dropped), state = once.run_manual(
            lambda *a, **kw: local(*a, **kw)[0], mesh=mesh, manual=manual, batch_specs=specs,
            reductions=reductions, params=params, batch=batch, args=args, gathers=gathers,
            gather_dtype=opts.gather[1]), None
        # fmt: on
    else:
        (loss, aux, grads, dropped), state = local(params, batch, args, specs, ())

    dtype = opts.grad_dtype  # None: each parameter's (jnp.dtype objects are truthy)
    grads = jax.tree.map(lambda g, p: g.astype(dtype or jnp.result_type(p)), grads, params)
    grads = acc.constrain_grads(grads)
    if opts.state_argnum is not None:
        aux = (aux, state)
    value = (loss, aux) if opts.has_aux else loss
    return (value, grads, dropped) if opts.skip_nonfinite else (value, grads)


def _loss_with_aux(opts: _Options, p, mb, *a) -> tuple:
    """(loss, (aux, new state)) of loss_fn (aux, state None when absent; `state.loss_output`)."""
    return st.loss_output(opts.loss_fn(p, mb, *a), opts.has_aux, opts.state_argnum is not None)


def _loop(opts, acc, params, batch, args, specs, vary, gathers=None, shards=None):
    """Run the k minibatches; returns (carry, stacked per-example aux, loss dtype, the state
    after the last one, or None: `state_argnum`).

    Shapes here are global, or per-device along the manual axes `vary` (reduce="once").
    gather="once": `params` gathered, `shards` theirs; weighted gradients reduce-scattered."""
    scatter = gather_once.scatter_fn(gathers, opts.gather[0])
    add = functools.partial(acc.add, scatter=scatter)
    k, mesh = opts.steps, opts.mesh
    leaves, treedef = jax.tree.flatten(batch)
    stacked = jax.tree.unflatten(
        treedef, [shd.split_leaf(x, k, mesh, s) for x, s in zip(leaves, specs, strict=True)]
    )
    vg = jax.value_and_grad(functools.partial(_loss_with_aux, opts), has_aux=True)
    loss_dtype = []  # filled while the body is traced

    def one_minibatch(mb, i, state):
        """((loss_i, aux_i, grads_i float32, w_i, ok_i), state after it) of minibatch i."""
        mb = jax.tree.unflatten(
            treedef,
            [shd.constrain(x, mesh, s) for x, s in zip(jax.tree.leaves(mb), specs, strict=True)],
        )
        args_i = st.with_state(
            rng.fold_keys(opts.rng_argnums, args, i, vary), opts.state_argnum, state
        )
        (loss_i, (aux_i, new_state)), g_i = vg(params, mb, *args_i)
        loss_dtype.append(jnp.result_type(loss_i))
        w_i = minibatch_weight(opts.weight_fn, mb)
        g_i = jax.tree.map(lambda g: g.astype(jnp.float32), g_i)
        g_i = g_i if scatter else acc.constrain_grads(g_i)  # full-size: the shard's spec later
        ok_i = all_finite(loss_i, w_i, g_i) if opts.skip_nonfinite else None
        return (loss_i, aux_i, g_i, w_i, ok_i), st.select(ok_i, new_state, state)

    state = st.state_arg(args, opts.state_argnum)
    carry = acc.init(shards if scatter else params)
    if vary:  # carries hold per-device partial sums
        carry = jax.tree.map(lambda x: jax.lax.pcast(x, vary, to="varying"), carry)
    if opts.loop == "scan":

        def body(c, xs):
            parts, state = one_minibatch(*xs, c[1])
            carry, per_example = add(c[0], *parts)
            return (carry, state), per_example

        xs = (stacked, jnp.arange(k))
        (carry, state), stacked_aux = jax.lax.scan(body, (carry, state), xs, length=k)
    else:
        pieces = []
        for i in range(k):
            parts, state = one_minibatch(jax.tree.map(lambda x, i=i: x[i], stacked), i, state)
            carry, per_example = add(carry, *parts)
            pieces.append(per_example)
        stacked_aux = jax.tree.map(lambda *xs: jnp.stack(xs), *pieces)
    return carry, stacked_aux, loss_dtype[0], state
