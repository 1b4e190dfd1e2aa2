"""trn_accum: gradient accumulation for JAX made for the Neuron compiler (AWS Trainium2).

The public API is the accumulation core; the Fuji model, trainer and launchers live in
submodules (`trn_accum.model.fuji`, `trn_accum.train`, `trn_accum.cli`).
"""

from trn_accum.accumulation import accumulate_gradients
from trn_accum.sharding import merge_minibatches, minibatch_specs, split_minibatches

__all__ = [
    "accumulate_gradients",
    "merge_minibatches",
    "minibatch_specs",
    "split_minibatches",
]
__version__ = "0.1.0"
