"""The accumulation core: JAX only (no model, trainer or Neuron code is imported here).

- `accumulate.py`: `accumulate_gradients` (split -> fixed-length loop -> exact weighted sum).
- `sharding.py`: the strided split and its inverse, PartitionSpec helpers, the batch
  divisibility and mesh-sizing rules, `build_mesh`, `constrain`.
"""

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.sharding import (
    build_mesh,
    constrain,
    merge_minibatches,
    minibatch_specs,
    split_minibatches,
)

__all__ = [
    "accumulate_gradients",
    "build_mesh",
    "constrain",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
