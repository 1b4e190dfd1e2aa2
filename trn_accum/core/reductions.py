"""Choosing how each aux leaf is reduced over minibatches, from shapes alone.

Reductions, one per aux leaf (`choose_reductions`):
  "mean"   Σ w_i x_i / Σ w_i (zero-weight minibatches dropped), like the loss
  "sum", "max", "min"  over all minibatches, unweighted (counts need "sum")
  "concat" per-example leaves [B/k, ...] stitched back into [B, ...] in the original row order
  "weighted" every `WeightedScalar` node, found without being named (`summaries`)
Unnamed leaves take the default: scalars -> "mean" (with an `AuxReductionWarning` when k > 1,
since a count or a max would need another reduction), leaves whose axis 0 follows the batch
size -> "concat" (checked by tracing `loss_fn`'s shapes on the full batch too: a leaf whose
axis 0 only happens to equal B/k is an error, not stitched), anything else -> ValueError.
Naming a leaf None (in a dict, or from a callable) asks for its default without the warning.
Warnings are Python warnings raised while tracing: nothing of this is in the compiled program.

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from trn_accum.core import summaries

__all__ = [
    "AUX_REDUCTIONS",
    "AuxReductionWarning",
    "check_aux_reduction",
    "choose_reductions",
    "plan_aux",
]

AUX_REDUCTIONS = ("mean", "sum", "max", "min", "concat")


class AuxReductionWarning(UserWarning):
    """An aux leaf was reduced by a default the caller did not name. Silence it by naming the
    leaf's reduction in `aux_reduction` (or with `warnings.filterwarnings`)."""


# ----------------------------------------------------------------------------- choosing


def check_aux_reduction(spec: Any) -> None:
    """ValueError (before tracing) if a string in `spec` is not one of AUX_REDUCTIONS."""
    if spec is None or callable(spec):
        return
    for path, red in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_none)[0]:
        if red is not None and red not in AUX_REDUCTIONS:
            where = f" at {jax.tree_util.keystr(path)}" if path else ""
            raise ValueError(f"aux_reduction={red!r}{where} must be one of {AUX_REDUCTIONS}")


def _is_none(x: Any) -> bool:
    return x is None


def _key_name(key: Any) -> Any:
    """The name in a key-path entry: a dict key, an attribute name or a sequence index (so a
    dict {"count": "sum"} names a NamedTuple's or dataclass's field `count` too)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _names(path: tuple) -> tuple:
    return tuple(_key_name(k) for k in path)


_UNNAMED = object()  # the caller gave no reduction for this leaf


def _named(spec: Any, flat: list) -> list:
    """Per aux leaf: the reduction the caller named, None (the default, asked for by name) or
    _UNNAMED. A dict or pytree may name a subset of aux (prefix paths); a name matching no
    aux leaf is a ValueError listing the aux leaves."""
    if spec is None:
        return [_UNNAMED] * len(flat)
    if isinstance(spec, str):
        return [spec] * len(flat)
    if callable(spec):
        return [spec(path) for path, _ in flat]
    entries = jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_none)[0]
    paths = [_names(path) for path, _ in flat]
    out, used = [], set()
    for names in paths:
        hits = [(len(p), i) for i, (p, _) in enumerate(entries) if names[: len(p)] == _names(p)]
        if hits:
            i = max(hits)[1]
            used.add(i)
        out.append(entries[i][1] if hits else _UNNAMED)
    unused = [jax.tree_util.keystr(p) for i, (p, _) in enumerate(entries) if i not in used]
    if unused:
        keys = ", ".join(jax.tree_util.keystr(path) or "<aux>" for path, _ in flat)
        raise ValueError(
            f"aux_reduction names {', '.join(unused)}, which matches no aux leaf; aux leaves: "
            f"{keys or 'none'}"
        )
    return out


def _suggest(path: tuple, red: str) -> str:
    """The aux_reduction that names one leaf, e.g. {'tokens': 'sum'}."""
    out = repr(red)
    for name in reversed(_names(path)):
        out = f"{{{name!r}: {out}}}"
    return out


def plan_aux(spec: Any, aux_at: Callable[[int], Any], batch_size: int, steps: int) -> tuple:
    """(aux shapes on one minibatch, reductions): `aux_at(rows)` gives aux shapes at `rows`
    rows (`jax.eval_shape`); the full batch's are traced only to check a default "concat"."""
    minibatch = batch_size // steps
    aux_shape = aux_at(minibatch)
    return aux_shape, choose_reductions(
        spec, aux_shape, minibatch, steps, lambda: aux_at(batch_size)
    )


def choose_reductions(
    spec: Any, aux: Any, minibatch_size: int, steps: int, full_batch_aux: Callable[[], Any]
) -> Any:
    """A tree like `aux` (shapes of one minibatch's aux) whose leaves are reduction names.

    `spec` is `aux_reduction`: None, one string, a callable `(key_path) -> str | None`, or a
    dict/pytree naming a subset of aux (None = the default). `full_batch_aux()` gives the aux
    shapes on the full batch; it is called only to check a default "concat" (k > 1).
    """
    flat, treedef = summaries.aux_flat(aux)
    full = []  # the full-batch aux leaves, computed at most once

    def follows_batch(i: int, shape: tuple) -> bool | None:
        """Whether leaf i's axis 0 is k × larger on the full batch (None: could not tell)."""
        if not full:
            try:
                full.append(jax.tree.leaves(full_batch_aux(), is_leaf=summaries.is_weighted))
            except Exception as e:  # a loss that only traces at B/k: warn below
                full.append(f"loss_fn did not trace on the full batch: {str(e)[:200]}")
        if isinstance(full[0], str) or len(full[0]) != len(flat):
            return None
        return np.shape(full[0][i]) == (minibatch_size * steps, *shape[1:])

    out = []
    for i, ((path, leaf), red) in enumerate(zip(flat, _named(spec, flat), strict=True)):
        name, shape = jax.tree_util.keystr(path) or "<aux>", np.shape(leaf)
        unnamed = red is _UNNAMED
        if summaries.is_weighted(leaf):
            out.append(_weighted(name, leaf, red, spec))
            continue
        if red is None or unnamed:
            red = _default(name, shape, minibatch_size)
            if red == "mean" and unnamed and steps > 1:
                warnings.warn(
                    f"aux leaf {name} is a scalar without a named reduction: it is averaged "
                    f"with the minibatch weights ('mean'), which is wrong for a count (needs "
                    f"'sum') or a max; name it to silence this, e.g. aux_reduction="
                    f"{_suggest(path, 'mean')}",
                    AuxReductionWarning,
                    stacklevel=2,
                )
            if red == "concat" and steps > 1:
                verdict = follows_batch(i, shape)
                if verdict is False:
                    raise ValueError(
                        f"aux leaf {name} has shape {shape} on a minibatch of {minibatch_size} "
                        f"rows but shape {np.shape(full[0][i])} on the full batch of "
                        f"{minibatch_size * steps}: its axis 0 is not per-example, so it is "
                        f"not stitched; name its reduction, one of {AUX_REDUCTIONS}, e.g. "
                        f"aux_reduction={_suggest(path, 'sum')}"
                    )
                if verdict is None and unnamed:
                    reason = full[0] if isinstance(full[0], str) else "aux structure differs"
                    warnings.warn(
                        f"aux leaf {name} (shape {shape}) is stitched as per-example because "
                        f"axis 0 = B/k = {minibatch_size}, unchecked ({reason}); name it to "
                        f"silence this, e.g. aux_reduction={_suggest(path, 'concat')}",
                        AuxReductionWarning,
                        stacklevel=2,
                    )
        if red not in AUX_REDUCTIONS:
            raise ValueError(f"aux_reduction for {name} is {red!r}, not one of {AUX_REDUCTIONS}")
        if red == "concat" and (shape == () or shape[0] != minibatch_size):
            raise ValueError(
                f"aux leaf {name} has shape {shape}: 'concat' needs axis 0 = the minibatch "
                f"size {minibatch_size} (B/k with k={steps})"
            )
        out.append(red)
    return jax.tree.unflatten(treedef, out)


def _default(name: str, shape: tuple, minibatch_size: int) -> str:
    if shape == ():
        return "mean"
    if shape[0] == minibatch_size:
        return "concat"
    raise ValueError(
        f"aux leaf {name} has shape {shape}: neither a scalar nor per-example (axis 0 = "
        f"minibatch size {minibatch_size}); give it an explicit aux_reduction, one of "
        f"{AUX_REDUCTIONS}"
    )


def _weighted(name: str, leaf: summaries.WeightedScalar, red: Any, spec: Any) -> str:
    """A WeightedScalar node reduces by its own weights: a name for it other than None (or one
    string for every leaf, which covers the plain leaves) is a ValueError."""
    summaries.check_scalar(name, leaf)
    if not (red is None or red is _UNNAMED or isinstance(spec, str)):
        raise ValueError(
            f"aux leaf {name} is a WeightedScalar: it combines by its own weights "
            f"(Σ mean·weight / Σ weight), so aux_reduction cannot name it ({red!r}); leave it "
            "out or name it None"
        )
    return summaries.WEIGHTED
