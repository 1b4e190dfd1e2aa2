"""Non-parameter state threaded through the minibatches in order (`state_argnum`).

    grad_fn(params, batch, ..., state, ...)          # state = args[state_argnum - 2]
    loss_fn(params, minibatch_i, ..., state_i, ...) -> (loss, (aux, state_{i+1}))
    minibatch 0 gets the given state, minibatch i the state minibatch i - 1 returned; grad_fn
    returns ((loss, (aux, state_k)), grads): what jax.value_and_grad(has_aux=True) returns

State is e.g. batch statistics or Flax NNX `Rngs` counters (`nnx.split(model, ...)`): no
gradient flows into it. Under `skip_nonfinite` a dropped minibatch's new state is discarded
(selection: the state before it is carried on). Not with reduce="once": each device would
update the state from its own rows, and no single state would come out. Flax NNX: split the
state off (`nnx.split(model, nnx.Param, nnx.RngState, ...)`) and merge it inside loss_fn with
`nnx.merge(..., copy=True)` (without the copy NNX refuses to update Variables of another trace).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trn_accum.core import rng
from trn_accum.core.reductions import plan_aux

__all__ = [
    "check_state_argnum",
    "check_state_out",
    "loss_output",
    "select",
    "state_arg",
    "with_state",
]


def check_state_argnum(state_argnum: Any, rng_argnums: tuple, has_aux: bool, reduce: str):
    """The argnum (None for None); ValueError unless an int >= 2 that is not a PRNG argnum,
    with has_aux=True and reduce="per_minibatch"."""
    if state_argnum is None:
        return None
    if isinstance(state_argnum, bool) or not isinstance(state_argnum, int) or state_argnum < 2:
        raise ValueError(
            f"state_argnum={state_argnum!r} must be an int >= 2: the index of the state among "
            "grad_fn(params, batch, *args)'s positional arguments (params = 0, batch = 1)"
        )
    if state_argnum in rng_argnums:
        raise ValueError(f"state_argnum={state_argnum} is also in rng_argnum={rng_argnums}")
    if not has_aux:
        raise ValueError(
            "state_argnum needs has_aux=True: loss_fn returns (loss, (aux, new_state)), as for "
            "jax.value_and_grad(loss_fn, has_aux=True)"
        )
    if reduce != "per_minibatch":
        raise ValueError(
            f'state_argnum needs reduce="per_minibatch" (got {reduce!r}): under "once" each '
            "device would update the state from its own rows"
        )
    return state_argnum


def loss_output(out: Any, has_aux: bool, has_state: bool) -> tuple[Any, tuple]:
    """(loss, (aux, new_state)) of what loss_fn returned (aux and state None when absent)."""
    if not has_aux:
        return out, (None, None)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(
            f"has_aux=True but loss_fn did not return a (loss, aux) pair: got {type(out).__name__}"
        )
    if not has_state:
        return out[0], (out[1], None)
    if not (isinstance(out[1], (tuple, list)) and len(out[1]) == 2):
        raise ValueError(
            "state_argnum is set but loss_fn's aux is not an (aux, new_state) pair: got "
            f"{type(out[1]).__name__}"
        )
    return out[0], (out[1][0], out[1][1])


def check_state_out(new_state: Any, state: Any) -> None:
    """ValueError unless loss_fn's new state (shapes) has the structure, shapes and dtypes of
    the state it was given: the loop carries it."""
    got = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), new_state)
    want = jax.tree.map(lambda x: (np.shape(x), jnp.result_type(x)), state)
    if jax.tree.structure(new_state) != jax.tree.structure(state) or got != want:
        raise ValueError(
            "loss_fn's new state must have the structure, shapes and dtypes of the state it "
            f"gets (it is carried to the next minibatch): got {got}, given {want}"
        )


def state_arg(args: tuple, argnum: int | None) -> Any:
    """args[argnum - 2] (None for argnum None); ValueError if grad_fn got no such argument."""
    if argnum is None:
        return None
    if argnum - 2 >= len(args):
        raise ValueError(
            f"state_argnum={argnum} but grad_fn got {2 + len(args)} positional arguments "
            "(params, batch, *args)"
        )
    return args[argnum - 2]


def with_state(args: tuple, argnum: int | None, state: Any) -> tuple:
    """args with args[argnum - 2] replaced by `state` (args itself for argnum None)."""
    if argnum is None:
        return args
    args = list(args)
    args[argnum - 2] = state
    return tuple(args)


def select(ok: Any, new: Any, old: Any) -> Any:
    """`new` where ok (scalar bool, None: always), else `old`, leaf by leaf."""
    if ok is None:
        return new
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def plan_outputs(loss_with_aux, opts, params, batch, args, batch_size: int) -> tuple:
    """(aux shapes, reductions), or (None, None) without aux, from shapes alone (`plan_aux`);
    checks the new state's shapes (`state_argnum`). `loss_with_aux(p, mb, *a)` -> (loss, (aux,
    new state)); `opts`: accumulate's options (has_aux, rng_argnums, state_argnum,
    aux_reduction, steps)."""
    if not opts.has_aux:
        return None, None

    def outputs_at(rows: int) -> tuple:  # (aux, new state) shapes at `rows` rows
        shaped = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
        args0 = rng.fold_keys(opts.rng_argnums, args, 0)
        return jax.eval_shape(loss_with_aux, params, shaped, *args0)[1]

    if opts.state_argnum is not None:  # ValueErrors: no such argument, or a state that changes
        state = state_arg(args, opts.state_argnum)
        check_state_out(outputs_at(batch_size // opts.steps)[1], state)
    return plan_aux(opts.aux_reduction, lambda rows: outputs_at(rows)[0], batch_size, opts.steps)
