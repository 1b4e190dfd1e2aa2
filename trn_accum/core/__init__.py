"""The accumulation core: JAX only (no model, trainer or Neuron code is imported here).

- `accumulate.py`: `accumulate_gradients` (validate -> strided split -> fixed-length loop ->
  exact weighted sum).
- `accumulator.py`: the float32 carry (init/add/finish) and the aux reductions.
- `reduce_once.py`: `reduce="once"` (the loop manual over the data axes, one psum after it).
- `sharding.py`: the strided split and its inverse, PartitionSpec helpers and checks, the batch
  divisibility and mesh-sizing rules, `build_mesh`, `constrain`.

Imports run accumulate -> reduce_once -> accumulator -> sharding.
"""

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.accumulator import AuxReductionWarning
from trn_accum.core.sharding import (
    build_mesh,
    constrain,
    merge_minibatches,
    minibatch_specs,
    split_minibatches,
)

__all__ = [
    "AuxReductionWarning",
    "accumulate_gradients",
    "build_mesh",
    "constrain",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
