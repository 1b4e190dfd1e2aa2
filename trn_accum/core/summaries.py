"""`WeightedScalar`: an aux metric that carries its own weight (AXLearn's weighted summaries).

    aux = {"accuracy": WeightedScalar(mean=correct.sum() / n, weight=n)}   # n rows with a label
    over minibatches:  mean = Σ meanᵢ·weightᵢ / Σ weightᵢ  (0 when Σ weightᵢ = 0, no NaN)
                       weight = Σ weightᵢ

It is a registered pytree (children `mean`, `weight`), found anywhere in aux without naming it
in `aux_reduction`: the accumulator treats the node as one leaf with the reduction "weighted".
A minibatch whose `weight` is 0 is dropped by selection (its mean may be 0/0 = NaN), and so is
one dropped by `skip_nonfinite`; `weight_fn` plays no part (the metric has its own weight).

Imports JAX (and numpy/stdlib) only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WEIGHTED", "WeightedScalar", "aux_flat", "aux_structure", "is_weighted"]

WEIGHTED = "weighted"  # the reduction of a WeightedScalar node (not one a caller names)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightedScalar:
    """A scalar `mean` over `weight` items (both 0-d: arrays, Python or NumPy numbers).

    Combining minibatches gives Σ mean·weight / Σ weight (0 if Σ weight = 0) and Σ weight;
    the result keeps the dtypes of `mean` and `weight`."""

    mean: Any
    weight: Any


def is_weighted(x: Any) -> bool:
    return isinstance(x, WeightedScalar)


def aux_flat(aux: Any) -> tuple[list, Any]:
    """`tree_flatten_with_path(aux)` with every WeightedScalar one leaf: ([(path, leaf)], def)."""
    return jax.tree_util.tree_flatten_with_path(aux, is_leaf=is_weighted)


def aux_structure(aux: Any) -> Any:
    """The treedef of `aux` with WeightedScalar nodes as leaves."""
    return jax.tree.structure(aux, is_leaf=is_weighted)


def check_scalar(name: str, ws: WeightedScalar) -> None:
    """ValueError unless both fields are 0-d (shapes from `jax.eval_shape`, before the loop)."""
    shapes = {f: np.shape(getattr(ws, f)) for f in ("mean", "weight")}
    if any(s != () for s in shapes.values()):
        raise ValueError(
            f"aux leaf {name} is a WeightedScalar with mean shape {shapes['mean']} and weight "
            f"shape {shapes['weight']}: both must be scalars (shape ())"
        )


def init() -> tuple[jax.Array, jax.Array]:
    """The carry of one WeightedScalar: (Σ mean·weight, Σ weight), float32 []."""
    return jnp.float32(0.0), jnp.float32(0.0)


def add(carry: tuple, ws: WeightedScalar, ok: Any = None) -> tuple[jax.Array, jax.Array]:
    """carry + one minibatch's WeightedScalar; dropped (by `jnp.where`) when its weight is 0 or
    `ok` (the minibatch's finiteness under skip_nonfinite) is False."""
    num, den = carry
    mean = jnp.asarray(ws.mean).astype(jnp.float32)
    weight = jnp.asarray(ws.weight).astype(jnp.float32)
    use = weight != 0 if ok is None else (weight != 0) & ok
    return num + jnp.where(use, mean * weight, 0.0), den + jnp.where(use, weight, 0.0)


def finish(carry: tuple, like: WeightedScalar) -> WeightedScalar:
    """The combined WeightedScalar, in the dtypes of `like` (shapes of one minibatch's)."""
    num, den = carry
    nonzero = den != 0
    mean = jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)
    return WeightedScalar(mean.astype(like.mean.dtype), den.astype(like.weight.dtype))
