"""The accumulation core: JAX only (no model, trainer or Neuron code is imported here).

- `accumulate.py`: `accumulate_gradients` (validate -> strided split -> fixed-length loop ->
  exact weighted sum).
- `accumulator.py`: the float32 carry (init/add/finish), `skip_nonfinite`'s selection.
- `reductions.py`: choosing each aux leaf's reduction from shapes (`aux_reduction`).
- `summaries.py`: `WeightedScalar`, an aux metric with its own weight.
- `reduce_once.py`: `reduce="once"` (the loop manual over the data axes, one psum after it).
- `sharding.py`: the strided split and its inverse, PartitionSpec helpers and checks, the batch
  divisibility and mesh-sizing rules, `build_mesh`, `constrain`.

Imports run accumulate -> reduce_once -> accumulator -> sharding, accumulate -> reductions,
and accumulator, reductions -> summaries.
"""

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.reductions import AuxReductionWarning
from trn_accum.core.sharding import (
    build_mesh,
    constrain,
    merge_minibatches,
    minibatch_specs,
    split_minibatches,
)
from trn_accum.core.summaries import WeightedScalar

__all__ = [
    "AuxReductionWarning",
    "WeightedScalar",
    "accumulate_gradients",
    "build_mesh",
    "constrain",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
