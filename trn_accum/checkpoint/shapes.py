"""A train state's shapes against a checkpoint's: abstract targets, leaf paths, and the leaves
whose stored shape differs, named before any array is read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def abstract_state(tree: Any) -> Any:
    """``ShapeDtypeStruct`` (with sharding where the leaf has one) for every array leaf of `tree`.

    Useful to restore into the layout of an existing state; for another mesh build the target
    from ``jax.eval_shape`` and the new shardings instead.
    """

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def shape_mismatches(stored: Mapping[str, tuple[int, ...]], abstract_target: Any) -> list[str]:
    """One 'path stored-shape (needs shape)' per leaf of `abstract_target` whose stored shape
    (`stored`: leaf path -> shape) differs or is missing, and one per stored leaf the target
    lacks. PRNG key leaves are stored as key data: only their presence is compared."""
    want = {
        leaf_path(p): None if is_key(x) else tuple(np.shape(x))
        for p, x in jax.tree.leaves_with_path(abstract_target)
    }
    bad = [
        f"{k} {stored[k] if k in stored else 'missing'} (needs {shape})"
        for k, shape in want.items()
        if k not in stored or (shape is not None and stored[k] != shape)
    ]
    return bad + [f"{k} {stored[k]} (not in the target)" for k in stored if k not in want]


def is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_path(keys) -> str:
    """'opt_state/1/mu/embed' for a key path (dict keys, indices and attributes alike)."""
    parts = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)
