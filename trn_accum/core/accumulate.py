"""Gradient accumulation with a static, communication-free minibatch layout.

`accumulate_gradients(loss_fn, steps=k, ...)` returns `grad_fn(params, batch, *args)` that
gives what `jax.value_and_grad(loss_fn, has_aux=...)(params, batch, *args)` gives on the full
batch, computed over k strided minibatches (see `trn_accum.core.split`):

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
`summaries`), `reduce="once"` in `reduce_once`, the threaded state (`state_argnum`) in `state`,
the options that go together in `strategy` (`Strategy`). grad_fn returns value_and_grad's pytree
whatever the Strategy; `grad_fn.with_stats` adds `AccumulationStats` (the dropped count).

Everything it emits is static: a fixed-length `lax.scan` or straight-line code, no `lax.cond`,
no host callbacks, no data-dependent loop bounds (Neuron constraints).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trn_accum.core import gather_once, mesh_types, rng
from trn_accum.core import reduce_once as once
from trn_accum.core import state as st
from trn_accum.core.accumulator import Accumulator, all_finite, minibatch_weight, value_and_grad_fn
from trn_accum.core.batch_rules import check_batch_spec_has_mesh, validate_batch, validate_steps
from trn_accum.core.constraints import constrain
from trn_accum.core.reductions import check_aux_reduction
from trn_accum.core.specs import as_spec, check_spec_axes, is_sharding_leaf, is_spec, leaf_shardings
from trn_accum.core.split import split_leaf
from trn_accum.core.strategy import AccumulationStats, Strategy, as_dtype, from_legacy

__all__ = ["AccumulationStats", "Strategy", "accumulate_gradients"]


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
    state_argnum: int | None
    strategy: Strategy


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
    state_argnum: int | None = None,
    strategy: Strategy | None = None,
    **deprecated: Any,
) -> Callable:
    """Wrap `loss_fn(params, batch, *args)` into `grad_fn(params, batch, *args)` that returns
    what `jax.value_and_grad(loss_fn, has_aux=has_aux)` returns on the full batch, `(loss,
    grads)` or `((loss, aux), grads)`, whatever the strategy, accumulated over `steps` strided
    minibatches. `grad_fn.with_stats(params, batch, *args)` returns `(that, AccumulationStats)`.

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
        are constrained to them (a spec that does not fit is a ValueError). None leaves and
        empty subtrees of `params` (`eqx.partition`'s) get no gradient and no constraint.
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
      state_argnum: index (>= 2) of a non-parameter state argument threaded through the
        minibatches in order (`core/state.py`): loss_fn returns `(loss, (aux, new_state))` and
        grad_fn `((loss, (aux, final_state)), grads)`. Needs has_aux, reduce="per_minibatch".
      strategy: a `Strategy` (default `Strategy()`): the loop, where gradients are reduced and
        gathered and in which dtypes, whether non-finite minibatches are dropped.
      **deprecated: the old keywords loop=, reduce=, gather=, gather_dtype=, reduce_dtype=,
        skip_nonfinite=, grad_dtype= (one release, a DeprecationWarning): the Strategy fields
        of the same names. Under the old skip_nonfinite=True grad_fn returns the old
        `(value, grads, dropped)`. Beside `strategy=` they are a TypeError.

    Returns:
      grad_fn(params, batch, *args); shapes are checked at trace time (ValueErrors name the
      leaf and the numbers). Called eagerly it runs as a `jax.jit` of itself (one compile per
      input signature; extra arguments must be arrays); inside a caller's trace, inline.
    """
    strategy, triple = from_legacy(strategy, deprecated)
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy={strategy!r} must be a trn_accum.Strategy")
    steps = validate_steps(steps)
    once.check_weight_fn(weight_fn, strategy.reduce)
    argnums = rng.check_rng_argnum(rng_argnum)
    state_argnum = st.check_state_argnum(state_argnum, argnums, has_aux, strategy.reduce)
    check_batch_spec_has_mesh(batch_spec, mesh)
    mesh = mesh_types.auto_mesh(mesh)  # any axis types: the same devices with Auto axes
    if mesh is not None and is_spec(batch_spec):
        check_spec_axes(as_spec(batch_spec), mesh)
    bare = jax.tree.leaves(param_specs, is_leaf=is_sharding_leaf)
    if mesh is None and any(isinstance(s, P) for s in bare):
        raise ValueError(
            "param_specs given as PartitionSpecs needs mesh=...; pass the mesh or NamedShardings"
        )
    check_aux_reduction(aux_reduction)
    opts = _Options(
        loss_fn=loss_fn,
        steps=steps,
        mesh=mesh,
        batch_spec=batch_spec,
        param_specs=param_specs,
        weight_fn=weight_fn,
        aux_reduction=aux_reduction,
        has_aux=bool(has_aux),
        rng_argnums=argnums,
        state_argnum=state_argnum,
        strategy=strategy,
    )

    @jax.jit
    def compiled(params, batch, *args):
        return _accumulate(opts, params, batch, args)

    with_stats = mesh_types.on_auto_mesh(
        compiled, lambda params, batch, *args: _accumulate(opts, params, batch, args), mesh
    )
    name = getattr(loss_fn, "__name__", "loss")

    def grad_fn(params, batch, *args):
        value_and_grads, stats = with_stats(params, batch, *args)
        return (*value_and_grads, stats.dropped) if triple else value_and_grads

    grad_fn.with_stats = with_stats
    grad_fn.__name__ = with_stats.__name__ = f"accumulated_{name}"
    grad_fn.__doc__ = f"{steps}-step accumulated value_and_grad of {loss_fn!r}."
    with_stats.__doc__ = f"(value_and_grad output, AccumulationStats) of {grad_fn.__name__}."
    return grad_fn


def _accumulate(opts: _Options, params: Any, batch: Any, args: tuple) -> Any:
    """validate -> strided split -> fixed-length loop -> exact weighted sum (traced); returns
    (value_and_grad's output, AccumulationStats)."""
    k, mesh, strategy = opts.steps, opts.mesh, opts.strategy
    batch_size, leaf_specs = validate_batch(batch, k, mesh=mesh, batch_spec=opts.batch_spec)
    rng.check_args(opts.rng_argnums, args)
    grad_shardings = leaf_shardings(opts.param_specs, params, mesh, what="param_specs")
    fsdp = strategy.gather != "per_minibatch"  # once, once_unsharded, in_loss: FSDP axes manual
    manual = once.manual_axes_for(mesh, leaf_specs, grad_shardings, fsdp, strategy.reduce == "once")
    gathers = gather_once.plan(grad_shardings, len(jax.tree.leaves(params)), manual, fsdp)
    aux_shape, reductions = st.plan_outputs(
        functools.partial(_loss_with_aux, opts), opts, params, batch, args, batch_size
    )
    acc = Accumulator(reductions, aux_shape, grad_shardings, strategy.skip_nonfinite)
    example_spec = P(leaf_specs[0][0] if mesh is not None and len(leaf_specs[0]) else None)
    calls = k * math.prod(mesh.shape[a] for a in manual)  # loss_fn calls: k × manual devices

    def local(params, batch, args, specs, vary, shards=None):
        out = _loop(opts, acc, params, batch, args, specs, vary, gathers, shards)
        carry, stacked_aux, loss_dtype, state = out
        if vary:  # reduce="once": the one reduction, after the loop
            narrow = as_dtype(strategy.reduce_dtype, "float32")
            carry = once.psum_carry(
                carry, acc.reductions, vary, gathers, strategy.gather, narrow, grad_shardings
            )
        counted = calls if strategy.skip_nonfinite else None
        return acc.finish(carry, stacked_aux, loss_dtype, mesh, example_spec, counted), state

    if manual:  # state_argnum is per_minibatch only: no state
        loss, aux, grads, dropped = once.run_manual(
            lambda *a, **kw: local(*a, **kw)[0],
            mesh=mesh,
            manual=manual,
            batch_specs=leaf_specs,
            reductions=reductions,
            params=params,
            batch=batch,
            args=args,
            gathers=gathers,
            gather_dtype=as_dtype(strategy.gather_dtype),
            in_loss=strategy.gather == "in_loss",
        )
        state = None
    else:
        (loss, aux, grads, dropped), state = local(params, batch, args, leaf_specs, ())

    dtype = as_dtype(strategy.grad_dtype)  # None: each parameter's
    grads = jax.tree.map(lambda g, p: g.astype(dtype or jnp.result_type(p)), grads, params)
    grads = acc.constrain_grads(grads)
    if opts.state_argnum is not None:
        aux = (aux, state)
    value = (loss, aux) if opts.has_aux else loss
    return (value, grads), AccumulationStats(dropped=dropped, calls=jnp.int32(calls))


def _loss_with_aux(opts: _Options, p, mb, *a) -> tuple:
    """(loss, (aux, new state)) of loss_fn (aux, state None when absent; `state.loss_output`)."""
    return st.loss_output(opts.loss_fn(p, mb, *a), opts.has_aux, opts.state_argnum is not None)


def _loop(opts, acc, params, batch, args, specs, vary, gathers=None, shards=None):
    """Run the k minibatches; returns (carry, stacked per-example aux, loss dtype, the state
    after the last one, or None: `state_argnum`).

    Shapes here are global, or per-device along the manual axes `vary` (reduce="once").
    gather="once": `params` gathered, `shards` theirs; weighted gradients reduce-scattered.
    gather="in_loss": `params` are the shards, loss_fn gathers them, its gradients summed over
    devices: each differentiates w_i * L_i, a non-finite minibatch dropped on every device."""
    scatter = gather_once.scatter_fn(gathers, opts.strategy.gather)
    in_loss = opts.strategy.gather == "in_loss"
    add = functools.partial(acc.add, scatter=scatter, prescaled=in_loss)
    k, mesh = opts.steps, opts.mesh
    leaves, treedef = jax.tree.flatten(batch)
    stacked = jax.tree.unflatten(
        treedef, [split_leaf(x, k, mesh, s) for x, s in zip(leaves, specs, strict=True)]
    )
    vg = value_and_grad_fn(functools.partial(_loss_with_aux, opts), opts.weight_fn, in_loss)
    loss_dtype = []  # filled while the body is traced

    def one_minibatch(mb, i, state):
        """((loss_i, aux_i, grads_i float32, w_i, ok_i), state after it) of minibatch i."""
        mb = jax.tree.unflatten(
            treedef,
            [constrain(x, mesh, s) for x, s in zip(jax.tree.leaves(mb), specs, strict=True)],
        )
        args_i = st.with_state(
            rng.fold_keys(opts.rng_argnums, args, i, vary), opts.state_argnum, state
        )
        (loss_i, (aux_i, new_state)), g_i = vg(params, mb, *args_i)
        loss_dtype.append(jnp.result_type(loss_i))
        w_i = minibatch_weight(opts.weight_fn, mb)
        g_i = jax.tree.map(lambda g: g.astype(jnp.float32), g_i)
        g_i = g_i if scatter else acc.constrain_grads(g_i)  # full-size: the shard's spec later
        check = opts.strategy.skip_nonfinite  # in_loss: dropped on every device or on none
        ok_i = all_finite(loss_i, w_i, g_i, axes=vary if in_loss else ()) if check else None
        return (loss_i, aux_i, g_i, w_i, ok_i), st.select(ok_i, new_state, state)

    state = st.state_arg(args, opts.state_argnum)
    carry = acc.init(shards if scatter else params)
    if vary:  # carries hold per-device partial sums
        carry = jax.tree.map(lambda x: jax.lax.pcast(x, vary, to="varying"), carry)
    if opts.strategy.loop == "scan":

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
