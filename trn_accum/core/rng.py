"""PRNG key arguments of `accumulate_gradients` (`rng_argnum`): which of grad_fn's positional
arguments are keys, and folding each of them per minibatch.

    rng_argnum = 2 or (2, 3)        # indices into grad_fn(params, batch, *args)
    minibatch i: every named key -> fold_in(key, i)   (and, inside reduce="once"'s manual
                 region, fold_in(., axis_index(manual axes)))

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["check_args", "check_rng_argnum", "fold_keys"]


def check_rng_argnum(rng_argnum: Any) -> tuple[int, ...]:
    """The argnums as a tuple (() for None); ValueError unless an int >= 2 or a tuple of them,
    without repeats."""
    if rng_argnum is None:
        return ()
    nums = tuple(rng_argnum) if isinstance(rng_argnum, (tuple, list)) else (rng_argnum,)
    bad = [n for n in nums if isinstance(n, bool) or not isinstance(n, int) or n < 2]
    if bad or not nums or len(set(nums)) != len(nums):
        raise ValueError(
            f"rng_argnum={rng_argnum!r} must be an int >= 2 or a tuple of distinct ones: the "
            "indices of PRNG keys among grad_fn(params, batch, *args)'s positional arguments "
            "(params = 0, batch = 1)"
        )
    return nums


def check_args(argnums: tuple[int, ...], args: tuple) -> None:
    """ValueError if an argnum is past grad_fn's positional arguments."""
    for n in argnums:
        if n - 2 >= len(args):
            raise ValueError(
                f"rng_argnum={n} but grad_fn got {2 + len(args)} positional arguments "
                "(params, batch, *args)"
            )


def fold_keys(argnums: tuple[int, ...], args: tuple, i, vary: tuple[str, ...] = ()) -> tuple:
    """args with each PRNG key named by `argnums` folded with the minibatch index i (and,
    inside the manual region of reduce="once", with the device's index along `vary`)."""
    args = list(args)
    for n in argnums:
        key = jax.random.fold_in(args[n - 2], i)
        if vary:
            key = jax.random.fold_in(key, jax.lax.axis_index(vary))
        args[n - 2] = key
    return tuple(args)
