"""Accumulation across calls as an optax transformation, without a conditional.

`multi_steps(inner, k, weight_fn=None)` is a drop-in for `optax.MultiSteps(inner, k)` for
batches that arrive in pieces (a streaming loader, host memory, a k that varies per step):
each `update` call adds one minibatch gradient, and every k-th call applies `inner` to

    Σ w_i g_i / Σ w_i        over the k calls of the step (0 when Σ w_i = 0)

and returns its updates (zeros on the other calls). With w_i the minibatch's number of real
target tokens this is the full batch's gradient, as `accumulate_gradients(weight_fn=...)` gives:
the same carry (`core.accumulator.Accumulator`: add, finish) does the weighting here, so a
zero-weight minibatch is dropped by selection, and a minibatch whose gradient, weight (or
`value`) is not finite, or whose weight is negative, is dropped and counted in `state.dropped`
(as `skip_nonfinite` does; a traced weight cannot raise). A step that kept nothing (Σ w_i = 0:
every weight 0, or every call dropped) applies nothing: zero updates, inner state (Adam's
moments and count) unchanged. `optax.MultiSteps` instead averages minibatch means (wrong when
the w_i differ) and branches with `lax.cond`.

How the weight reaches `update` (optax's extra-args convention):

    update(grads, state, params, weight=w)   # weight_fn=None: w, e.g. the loss aux's token
                                             #   count; omitted: 1 (equal weights)
    update(grads, state, params, batch=mb)   # weight_fn given: w = weight_fn(mb), the same
                                             #   function `accumulate_gradients` takes
    update(..., value=loss_i)                # optional: checked for finiteness, and the
                                             #   inner transformation gets the step's
                                             #   weighted mean loss as its `value`

Gradient leaves of dtype float0 (`jax.grad(allow_int=True)`'s placeholder for an integer
parameter) are refused with a ValueError naming them. Other extra args pass to `inner`
unchanged. Everything is selected with `jnp.where`: `inner`'s update is computed on every
call (as `optax.MultiSteps` computes its own) and kept on the k-th.
`state.k` is an int32 array: change it between calls (`with_k`) without recompiling.

Imports trn_accum.core, JAX and optax only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.dtypes import float0

from trn_accum.core.accumulator import Accumulator, Carry, all_finite, minibatch_weight
from trn_accum.errors import listed

__all__ = ["MultiStepsState", "has_updated", "multi_steps", "with_k"]


class MultiStepsState(NamedTuple):
    """State of `multi_steps` (the field names `optax.MultiStepsState` has, where they mean
    the same thing)."""

    mini_step: jax.Array  # int32 []: calls of the current step so far (0 .. k-1)
    gradient_step: jax.Array  # int32 []: steps completed (applied or all-dropped)
    k: jax.Array  # int32 []: calls per step; `with_k` changes it without a recompile
    inner_opt_state: Any
    acc: Carry  # float32 sums of the current step: Σ w·L, Σ w, Σ w·g, dropped calls
    dropped: jax.Array  # int32 []: calls dropped since init (non-finite, or a weight < 0)

    @property
    def acc_grads(self) -> Any:
        """Σ w_i g_i of the current step (float32, the parameters' structure and sharding)."""
        return self.acc.grads


def _check_k(k: Any) -> jax.Array:
    """k as an int32 scalar array. ValueError naming k and the rule unless k is a positive
    integer scalar: a Python or numpy int, or an integer array of shape () (traced: its value
    is known only when the step runs). Strings, lists, bools and floats are refused."""
    rule = "must be a positive integer (calls per optimizer step, e.g. k=4; 1 = every call)"
    if isinstance(k, (bool, np.bool_)) or not _is_integer_scalar(k):
        raise ValueError(f"multi_steps: k={k!r} {rule}")
    try:
        value = int(k)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return jnp.asarray(k, jnp.int32)  # traced
    if not 1 <= value <= np.iinfo(np.int32).max:
        limit = "" if value < 1 else f" of at most {np.iinfo(np.int32).max} (int32)"
        raise ValueError(f"multi_steps: k={value} {rule}{limit}")
    return jnp.asarray(value, jnp.int32)


def _is_integer_scalar(k: Any) -> bool:
    """k is an int, a numpy integer or an integer array of shape () (jax or numpy)."""
    if isinstance(k, (int, np.integer)):
        return True
    dtype = getattr(k, "dtype", None)
    return dtype is not None and np.shape(k) == () and jnp.issubdtype(dtype, jnp.integer)


def with_k(state: MultiStepsState, k: Any) -> MultiStepsState:
    """`state` with k calls per step from now on (an int32 array: no recompile). A k at or
    below the calls already made ends the current step at the next call."""
    return state._replace(k=_check_k(k))


def has_updated(state: MultiStepsState) -> jax.Array:
    """Bool []: the last `update` call ended a step (as `optax.MultiSteps.has_updated`)."""
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)


def multi_steps(
    inner: optax.GradientTransformation, k: Any, weight_fn: Callable | None = None
) -> optax.GradientTransformationExtraArgs:
    """Accumulate `k` calls' gradients, weighted, then apply `inner` once (see the module).

    Args:
      inner: the optax transformation applied once per step.
      k: calls per step, a positive int or an integer scalar array (the initial `state.k`);
        anything else ("4", [2, 2], 0, True, 2.0) is a ValueError naming k.
      weight_fn: `weight_fn(minibatch) -> scalar` w_i, as `accumulate_gradients` takes it;
        `update` then needs `batch=minibatch`. None: `update(..., weight=w_i)`, default 1.

    Returns:
      An optax `GradientTransformationExtraArgs`; its state is a `MultiStepsState`.
    """
    k0 = _check_k(k)
    inner = optax.with_extra_args_support(inner)
    acc = Accumulator(None, None, None, count_dropped=True)

    def init(params: Any) -> MultiStepsState:
        zero, f0 = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
        grads = optax.tree.zeros_like(params, dtype=jnp.float32)  # keeps each leaf's sharding
        carry = Carry(loss=f0, weight=f0, grads=grads, aux=[], dropped=f0)
        return MultiStepsState(zero, zero, k0, inner.init(params), carry, zero)

    def update(updates, state: MultiStepsState, params=None, **extra_args):
        _refuse_float0(updates)
        w_i = _weight(weight_fn, extra_args)
        value = extra_args.pop("value", None)
        g_i = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), updates)
        finite = all_finite(w_i, g_i) if value is None else all_finite(w_i, g_i, value)
        ok = finite & (w_i >= 0)  # a negative weight would step uphill: dropped, counted
        loss_i = jnp.float32(0.0) if value is None else value
        carry, _ = acc.add(state.acc, loss_i, None, g_i, w_i, ok)
        calls = state.mini_step + 1
        loss, _, grads, _ = acc.finish(carry, None, jnp.float32, None, None, calls)
        if value is not None:
            extra_args["value"] = loss  # the step's weighted mean loss
        grads = optax.tree.cast_like(grads, updates)
        new_updates, new_inner = inner.update(grads, state.inner_opt_state, params, **extra_args)
        emit = calls >= state.k
        # Nothing kept (every weight 0, or every call dropped: Σ w = 0) applies nothing, as
        # does a sum that overflowed.
        applied = emit & (carry.weight > 0) & all_finite(grads)
        new_inner = jax.tree.map(
            lambda new, old: jnp.where(applied, new, old).astype(jnp.result_type(old)),
            new_inner,
            state.inner_opt_state,
        )
        new_updates = jax.tree.map(lambda u: jnp.where(applied, u, jnp.zeros_like(u)), new_updates)
        fresh = jax.tree.map(jnp.zeros_like, carry)  # a step with no calls yet
        new_state = MultiStepsState(
            mini_step=jnp.where(emit, 0, calls).astype(jnp.int32),
            gradient_step=state.gradient_step + emit.astype(jnp.int32),
            k=state.k,
            inner_opt_state=new_inner,
            acc=jax.tree.map(lambda f, c: jnp.where(emit, f, c), fresh, carry),
            dropped=state.dropped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)


def _refuse_float0(updates: Any) -> None:
    """ValueError naming the gradient leaves of dtype float0: the zero tangent that
    `jax.grad(..., allow_int=True)` gives an integer parameter, which has no arithmetic (no
    sum, no optimizer, no `optax.apply_updates`)."""
    leaves = jax.tree_util.tree_leaves_with_path(updates)
    bad = [jax.tree_util.keystr(p) for p, g in leaves if getattr(g, "dtype", None) == float0]
    if bad:
        raise ValueError(
            f"multi_steps: gradient leaf {listed(bad, sep=', ')} has dtype float0 (what "
            f"jax.grad(allow_int=True) gives an integer parameter), which cannot be summed or "
            f"applied: take the gradient of the float parameters only (pass integer leaves to "
            f"the loss as another argument)"
        )


def _weight(weight_fn: Callable | None, extra_args: dict) -> jax.Array:
    """w_i (float32 []) from `update`'s extra args, which loses `weight` and `batch`."""
    weight, batch = extra_args.pop("weight", None), extra_args.pop("batch", None)
    if weight_fn is None:
        if batch is not None:
            raise ValueError(
                "multi_steps: update(batch=...) needs multi_steps(weight_fn=...); without "
                "weight_fn pass the weight itself, update(..., weight=w)"
            )
        return minibatch_weight(None if weight is None else lambda _: weight, None)
    if weight is not None or batch is None:
        raise ValueError(
            "multi_steps(weight_fn=...): pass the minibatch, update(..., batch=mb), and no "
            "weight= (weight_fn computes it)"
        )
    return minibatch_weight(weight_fn, batch)
