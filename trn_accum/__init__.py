"""trn_accum: gradient accumulation for JAX made for the Neuron compiler (AWS Trainium2).

The public API is the accumulation core (`trn_accum.core`):

    from trn_accum import accumulate_gradients, build_mesh, Strategy, WeightedScalar

The Fuji model (`trn_accum.model`), the trainer (`trn_accum.train`), the Neuron support
(`trn_accum.neuron`), the compiled-program analysis (`trn_accum.analysis`), the launchers
(`trn_accum.cluster`) and the `trn-accum` command (`trn_accum.cli`) build on it.
"""

from trn_accum.core import (
    AccumulationStats,
    Strategy,
    WeightedScalar,
    accumulate_gradients,
    build_mesh,
    constrain,
    merge_minibatches,
    minibatch_specs,
    split_minibatches,
)

__all__ = [
    "AccumulationStats",
    "Strategy",
    "WeightedScalar",
    "accumulate_gradients",
    "build_mesh",
    "constrain",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
__version__ = "0.1.0"
