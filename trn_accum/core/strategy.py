"""How `accumulate_gradients` runs its k minibatches: one frozen value, `Strategy`.

The options that only make sense together travel as one value, checked once, when it is made:

    Strategy()                                        # per-minibatch reduction, lax.scan
    Strategy(reduce="once")                           # one psum after the loop (`reduce_once`)
    Strategy(reduce="once", gather="once_unsharded", gather_dtype="bfloat16",
             reduce_dtype="bfloat16")                 # FSDP weights gathered once (`gather_once`)
    Strategy(skip_nonfinite=True)                     # drop non-finite minibatches, count them

None of them changes what grad_fn returns (`jax.value_and_grad`'s pytree); the count of dropped
minibatches is `grad_fn.with_stats`'s `AccumulationStats`. This module is the one home of the
choice lists (LOOPS, REDUCES, GATHERS, REDUCE_DTYPES; the trainer's config reads them) and of
the rules between the options. Imports JAX only.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "GATHERS",
    "LEGACY_KEYWORDS",
    "LOOPS",
    "REDUCES",
    "REDUCE_DTYPES",
    "AccumulationStats",
    "Strategy",
    "as_dtype",
    "from_legacy",
]

LOOPS = ("scan", "unroll")
REDUCES = ("per_minibatch", "once")
GATHERS = ("per_minibatch", "once", "once_unsharded", "in_loss")
REDUCE_DTYPES = ("float32", "bfloat16")  # reduce="once"'s cross-replica gradient reduction


class AccumulationStats(NamedTuple):
    """What `grad_fn.with_stats(params, batch, *args)` returns beside value_and_grad's output.

    dropped: int32 [] -- loss_fn calls dropped as non-finite (`Strategy.skip_nonfinite`; 0
      without it). Calls are minibatches, or minibatch × device pieces under reduce="once".
    calls: int32 [] -- loss_fn calls made: k, or k × the devices along the manual axes.
    """

    dropped: jax.Array
    calls: jax.Array


def _dtype_name(value: Any, field: str) -> str | None:
    """`value` (a name or a dtype-like) as a dtype name; None stays None."""
    if value is None:
        return None
    try:
        return jnp.dtype(value).name
    except TypeError:
        raise ValueError(
            f"Strategy({field}={value!r}): not a dtype; pass a name such as 'bfloat16'"
        ) from None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the minibatch loop runs and where its gradients are reduced (frozen, hashable).

    loop: "scan" (a fixed-length `lax.scan`: the memory of one minibatch) or "unroll" (a Python
      loop: every slice static). Same numbers.
    reduce: "per_minibatch" (XLA reduces each minibatch's gradient across devices) or "once":
      the loop manual over the pure data-parallel axes, one psum after it (`reduce_once`). It
      needs an explicit, row-additive `weight_fn` and `trn_accum.constrain` in `loss_fn`.
    gather: under reduce="once", FSDP weights gathered "per_minibatch" (by XLA), "once" /
      "once_unsharded" per step (`gather_once`), or "in_loss": the loop manual over the FSDP
      axes too, `loss_fn` given each weight's shard (sharded over the manual axes as
      `param_specs` says) and gathering it where it uses it, its gradient the shard's (e.g.
      `trn_accum.model.fsdp.sharded_loss(..., given_shards=True)`, per layer). Its gradient
      crosses devices inside loss_fn, before any selection: loss_fn must stay finite on rows
      of zero weight (a masked mean over max(count, 1), as fuji.mean_loss). gather_dtype: the
      dtype "once" and "once_unsharded" gather in (None: the weights' own).
    reduce_dtype: under reduce="once", the dtype the accumulated gradients cross replicas in:
      "float32" or "bfloat16" (half the bytes, bf16 rounding). Accumulation is float32.
    skip_nonfinite: drop, by selection, each loss_fn call whose loss, weight or any gradient
      element is not finite; the rest give the full batch's numbers over their rows alone. The
      count is `AccumulationStats.dropped`. All dropped: loss and grads NaN.
    grad_dtype: dtype of the returned gradients; None: each parameter's, as value_and_grad.

    Every rule between the fields is checked here: ValueError naming the value, the rule, a fix.
    """

    loop: str = "scan"
    reduce: str = "per_minibatch"
    gather: str = "per_minibatch"
    gather_dtype: Any = None
    reduce_dtype: str = "float32"
    skip_nonfinite: bool = False
    grad_dtype: Any = None

    def __post_init__(self):
        for name, dtype in (("gather_dtype", self.gather_dtype), ("grad_dtype", self.grad_dtype)):
            object.__setattr__(self, name, _dtype_name(dtype, name))
        object.__setattr__(self, "reduce_dtype", _dtype_name(self.reduce_dtype, "reduce_dtype"))
        choices = (
            ("loop", LOOPS),
            ("reduce", REDUCES),
            ("gather", GATHERS),
            ("reduce_dtype", REDUCE_DTYPES),
        )
        for name, allowed in choices:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Strategy({name}={value!r}): {name} must be one of {allowed}")
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(
                f"Strategy(skip_nonfinite={self.skip_nonfinite!r}): must be True or False"
            )
        if self.gather != "per_minibatch" and self.reduce != "once":
            raise ValueError(
                f'Strategy(gather={self.gather!r}) needs reduce="once" (the minibatch loop '
                "manual over the batch axes, where the weights are gathered before it): pass "
                'reduce="once" or gather="per_minibatch"'
            )
        if self.gather_dtype is not None and self.gather in ("per_minibatch", "in_loss"):
            raise ValueError(
                f"Strategy(gather_dtype={self.gather_dtype!r}) needs gather='once' or "
                f"'once_unsharded' ({self.gather} gathers are XLA's or loss_fn's, in the dtype "
                "they choose): pass one of them or drop gather_dtype"
            )
        if self.reduce_dtype != "float32" and self.reduce != "once":
            raise ValueError(
                f'Strategy(reduce_dtype={self.reduce_dtype!r}) needs reduce="once" (it narrows '
                'the one cross-replica reduction after the loop): pass reduce="once" or '
                'reduce_dtype="float32"'
            )


LEGACY_KEYWORDS = tuple(f.name for f in dataclasses.fields(Strategy))


def as_dtype(name: str | None, default: str | None = None) -> Any:
    """A Strategy's dtype name as a jnp.dtype; None (or `default`'s name) -> None."""
    return None if name is None or name == default else jnp.dtype(name)


def from_legacy(strategy: Strategy | None, legacy: dict) -> tuple[Strategy, bool]:
    """(the Strategy, whether grad_fn keeps the old 3-tuple) for accumulate_gradients' old
    keywords (deprecated for one release): a DeprecationWarning naming the Strategy fields;
    TypeError for an unknown keyword or for old keywords beside `strategy=`."""
    unknown = sorted(set(legacy) - set(LEGACY_KEYWORDS))
    if unknown:
        raise TypeError(f"accumulate_gradients() got unexpected keyword arguments {unknown}")
    if not legacy:
        return (Strategy() if strategy is None else strategy), False
    names = ", ".join(f"{k}=" for k in legacy)
    if strategy is not None:
        raise TypeError(
            f"accumulate_gradients() got both strategy= and the old keywords {names}: pass "
            "only strategy=, with them in it (dataclasses.replace(strategy, ...))"
        )
    if legacy.get("gather", "per_minibatch") == "per_minibatch":  # gather_dtype was ignored
        legacy = {k: v for k, v in legacy.items() if k != "gather_dtype"}
    triple = bool(legacy.get("skip_nonfinite"))
    fields = ", ".join(f"{k}={legacy[k]!r}" for k in legacy)
    note = (
        "; under the old skip_nonfinite=True grad_fn still returns (value, grads, dropped) "
        "for this release: with strategy=, grad_fn returns (value, grads) as "
        "jax.value_and_grad does and grad_fn.with_stats(...) gives the count"
        if triple
        else ""
    )
    warnings.warn(
        f"accumulate_gradients({names} ...) is deprecated and goes in the next release: "
        f"pass strategy=trn_accum.Strategy({fields}) (the Strategy fields of the same "
        f"names){note}",
        DeprecationWarning,
        stacklevel=3,
    )
    return Strategy(**legacy), triple  # after the warning: the Strategy's rules apply too
