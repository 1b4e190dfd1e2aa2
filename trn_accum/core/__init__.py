"""The accumulation core: JAX only (no model, trainer or Neuron code is imported here).

- `strategy.py`: `Strategy` (loop, reduce, gather, dtypes, skip_nonfinite: the rules between
  them), `AccumulationStats` (`grad_fn.with_stats`).
- `accumulate.py`: `accumulate_gradients` (validate -> strided split -> fixed-length loop ->
  exact weighted sum).
- `accumulator.py`: the float32 carry (init/add/finish), `skip_nonfinite`'s selection.
- `reductions.py`: choosing each aux leaf's reduction from shapes (`aux_reduction`).
- `summaries.py`: `WeightedScalar`, an aux metric with its own weight.
- `reduce_once.py`: `reduce="once"` (the loop manual over the data axes, one psum after it).
- `split.py`: the strided split and its inverse; `specs.py`: PartitionSpec helpers and checks;
  `batch_rules.py`: the batch divisibility rule; `mesh.py`: the mesh-sizing rule, `build_mesh`;
  `constraints.py`: `constrain`, `varying_like`.

Imports run accumulate -> reduce_once -> accumulator -> split, specs, constraints, mesh,
accumulate -> reductions,
and accumulator, reductions -> summaries.
"""

from trn_accum.core.accumulate import accumulate_gradients
from trn_accum.core.constraints import constrain
from trn_accum.core.mesh import build_mesh
from trn_accum.core.reductions import AuxReductionWarning
from trn_accum.core.split import merge_minibatches, minibatch_specs, split_minibatches
from trn_accum.core.strategy import AccumulationStats, Strategy
from trn_accum.core.summaries import WeightedScalar

__all__ = [
    "AccumulationStats",
    "AuxReductionWarning",
    "Strategy",
    "WeightedScalar",
    "accumulate_gradients",
    "build_mesh",
    "constrain",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
