"""The float32 carry of the minibatch loop: init / add / finish, per aux leaf by its reduction.

    carry = Carry(loss=Σ w_i·L_i, weight=Σ w_i, grads=Σ w_i·g_i, aux=[per-leaf carries],
                  dropped=number of loss_fn calls dropped as non-finite)
    init(params) -> carry;  add(carry, L_i, aux_i, g_i, w_i, ok_i) -> carry;  finish(carry)

Sums are float32 (float64 leaves stay float64); a minibatch with w_i == 0, or with ok_i False
(`skip_nonfinite`: its loss, weight or a gradient is not finite), is dropped by selection
(`jnp.where`), so its NaN (0/0, or the non-finite values) does not leak; Σ w_i == 0 gives 0.
The reductions are chosen in `reductions` ("mean", "sum", "max", "min", "concat", "weighted").

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trn_accum.core import summaries
from trn_accum.core.constraints import constrain, constrain_leaves
from trn_accum.core.specs import cut_spec
from trn_accum.core.split import merge_minibatches

__all__ = ["Accumulator", "Carry", "all_finite", "value_and_grad_fn"]


def all_finite(*trees: Any, axes: tuple[str, ...] = ()) -> jax.Array:
    """Scalar bool: every element of every leaf of `trees` is finite (on every device along
    the manual mesh axes `axes`, when given)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(trees)]
    ok = jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
    return jax.lax.pmin(ok.astype(jnp.int32), axes) > 0 if axes else ok


class Carry(NamedTuple):
    """Loop state: float32 sums, sharded like the parameters for `grads`."""

    loss: jax.Array  # Σ w_i·L_i, float32 []
    weight: jax.Array  # Σ w_i, float32 []
    grads: Any  # Σ w_i·g_i, float32, params' structure
    aux: list  # one carry per aux leaf (None for "concat": stacked by the loop instead)
    dropped: Any  # float32 []: loss_fn calls dropped as non-finite (None: not counted)


def _identity(red: str, dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if red in ("mean", "sum"):
        return 0
    if dtype == jnp.bool_:
        return red == "min"
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if red == "max" else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if red == "max" else info.max


def _acc_dtype(red: str, dtype: Any) -> Any:
    dtype = jnp.dtype(dtype)
    if red == "mean" or (red == "sum" and jnp.issubdtype(dtype, jnp.floating)):
        return jnp.float32 if dtype.itemsize <= 4 else dtype
    return dtype


class Accumulator:
    """init / add / finish of the carry. `reductions` and `aux_shape` are trees like aux (None
    without aux; WeightedScalar nodes are leaves); `grad_shardings` is
    `leaf_shardings(param_specs, params, ...)`: the gradient sums are constrained to the
    parameters' shardings after every step. `count_dropped` (skip_nonfinite) carries the
    dropped count (float32, so that reduce="once" sums it in the one float32 psum)."""

    def __init__(self, reductions, aux_shape, grad_shardings: list | None, count_dropped=False):
        self.aux_shape, self.count_dropped = aux_shape, count_dropped
        self.grad_shardings = grad_shardings
        self.reductions = [] if reductions is None else jax.tree.leaves(reductions)
        self.shapes = [] if aux_shape is None else _aux_leaves(aux_shape)

    def constrain_grads(self, grads: Any) -> Any:
        return constrain_leaves(grads, self.grad_shardings)

    def init(self, params: Any) -> Carry:
        zeros = jax.tree.map(lambda p: jnp.zeros(np.shape(p), jnp.float32), params)
        aux = [_init_aux(red, s) for red, s in zip(self.reductions, self.shapes, strict=True)]
        f0 = jnp.float32(0.0)
        dropped = f0 if self.count_dropped else None
        return Carry(f0, f0, self.constrain_grads(zeros), aux, dropped)

    def add(
        self, carry: Carry, loss_i, aux_i, g_i, w_i, ok_i=None, scatter=None, prescaled=False
    ) -> tuple[Carry, list]:
        """carry + minibatch i; also returns its per-example ("concat") aux leaves. `ok_i`
        (scalar bool, or None: no check) False drops the minibatch from every sum, "max" and
        "min" by selection and counts it in `dropped`. `scatter` (gather="once"): applied to
        the weighted gradient tree before it is added. `prescaled` (gather="in_loss"): `g_i`
        is already the gradient of w_i * loss_i summed over devices, added unless `ok_i` is
        False (a zero w_i adds its zero share through it)."""
        keep = w_i != 0 if ok_i is None else (w_i != 0) & ok_i
        loss = carry.loss + jnp.where(keep, w_i * jnp.asarray(loss_i).astype(jnp.float32), 0.0)
        weight = carry.weight + jnp.where(keep, w_i, 0.0)
        if prescaled:
            ok = True if ok_i is None else ok_i
            weighted = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), g_i)
        else:
            weighted = jax.tree.map(lambda g: jnp.where(keep, w_i * g, 0.0), g_i)
        weighted = weighted if scatter is None else self.constrain_grads(scatter(weighted))
        grads = jax.tree.map(jnp.add, carry.grads, weighted)
        new_aux, per_example = [], []
        xs = _aux_leaves(aux_i) if self.reductions else []
        for red, acc, x in zip(self.reductions, carry.aux, xs, strict=True):
            if red == "concat":
                per_example.append(x)
                new_aux.append(None)
            elif red == summaries.WEIGHTED:
                new_aux.append(summaries.add(acc, x, ok_i))
            else:
                new_aux.append(_add_aux(red, acc, x, w_i, keep, ok_i))
        dropped = carry.dropped if ok_i is None else carry.dropped + jnp.where(ok_i, 0.0, 1.0)
        return Carry(loss, weight, self.constrain_grads(grads), new_aux, dropped), per_example

    def finish(
        self, carry: Carry, stacked_aux: list, loss_dtype, mesh, example_spec, calls=None
    ) -> tuple:
        """(loss, aux, grads float32, dropped int32): the sums divided by Σ w (0 when Σ w = 0);
        per-example aux [k, B/k, ...] merged back to [B, ...] and constrained to
        `example_spec`. `calls` (skip_nonfinite): the number of loss_fn calls; when all of them
        were dropped, loss and grads are NaN (no finite value remained), not 0."""
        total = carry.weight
        nonzero = total != 0
        safe = jnp.where(nonzero, total, 1.0)
        loss = jnp.where(nonzero, carry.loss / safe, 0.0)
        grads = jax.tree.map(lambda a: jnp.where(nonzero, a / safe, 0.0), carry.grads)
        if calls is not None:
            none_left = carry.dropped == calls
            loss = jnp.where(none_left, jnp.nan, loss)
            grads = jax.tree.map(lambda g: jnp.where(none_left, jnp.nan, g), grads)
        loss, grads = loss.astype(loss_dtype), self.constrain_grads(grads)
        dropped = jnp.int32(0) if carry.dropped is None else carry.dropped.astype(jnp.int32)
        if self.aux_shape is None:
            return loss, None, grads, dropped
        out, per_example = [], iter(stacked_aux or [])
        for red, s, acc in zip(self.reductions, self.shapes, carry.aux, strict=True):
            if red == "concat":
                merged = merge_minibatches(next(per_example)).astype(s.dtype)
                out.append(constrain(merged, mesh, cut_spec(example_spec, merged.ndim)))
            elif red == summaries.WEIGHTED:
                out.append(summaries.finish(acc, s))
            elif red == "mean":
                out.append(jnp.where(nonzero, acc / safe.astype(acc.dtype), 0).astype(s.dtype))
            else:
                out.append(acc.astype(s.dtype))
        aux = jax.tree.unflatten(summaries.aux_structure(self.aux_shape), out)
        return loss, aux, grads, dropped


def _aux_leaves(aux: Any) -> list:
    return jax.tree.leaves(aux, is_leaf=summaries.is_weighted)


def _init_aux(red: str, s: Any) -> Any:
    if red == "concat":
        return None
    if red == summaries.WEIGHTED:
        return summaries.init()
    return jnp.full(s.shape, _identity(red, s.dtype), _acc_dtype(red, s.dtype))


def _add_aux(red: str, acc, x, w_i, keep, ok_i):
    """One "mean", "sum", "max" or "min" carry + x (a Python number counts as a 0-d array);
    "mean" drops x where `keep` is False, the others where `ok_i` is False (None: never)."""
    x = jnp.asarray(x).astype(acc.dtype)
    if red == "mean":
        return acc + jnp.where(keep, w_i.astype(acc.dtype) * x, 0)
    if red == "sum":
        new = acc + x
    else:
        new = jnp.maximum(acc, x) if red == "max" else jnp.minimum(acc, x)
    return new if ok_i is None else jnp.where(ok_i, new, acc)


def minibatch_weight(weight_fn, mb) -> jax.Array:
    """w_i = weight_fn(minibatch) as a float32 scalar (1 when weight_fn is None)."""
    w_i = jnp.asarray(jnp.float32(1.0) if weight_fn is None else weight_fn(mb), jnp.float32)
    if np.shape(w_i) != ():
        raise ValueError(f"weight_fn must return a scalar, got shape {np.shape(w_i)}")
    return w_i


def value_and_grad_fn(loss_fn, weight_fn, prescaled: bool = False):
    """`vg(p, mb, *a) -> ((loss, rest), grads)` of `loss_fn(p, mb, *a) -> (loss, rest)`.
    `prescaled` (gather="in_loss"): the grads of w * loss, w = weight_fn(mb)
    (`minibatch_weight`), for `Accumulator.add(prescaled=True)`: the transposes of loss_fn's
    gathers sum the gradient over devices before any weight could be applied."""
    if not prescaled:
        return jax.value_and_grad(loss_fn, has_aux=True)

    def weighted(p, mb, *a):
        loss, rest = loss_fn(p, mb, *a)
        w = minibatch_weight(weight_fn, mb)
        return w * jnp.asarray(loss).astype(jnp.float32), (loss, rest)

    vg = jax.value_and_grad(weighted, has_aux=True)

    def run(p, mb, *a):
        (_, (loss, rest)), grads = vg(p, mb, *a)
        return (loss, rest), grads

    return run
