"""The run configuration's sections as frozen dataclasses, with their defaults and the choice
lists of their keys (each from the module that implements it): `Config` and one class per
section ([model], [mesh], [data], [optimizer], [trainer], [checkpoint]). Loading and
validation live in `trn_accum.config.load`."""

from __future__ import annotations

from dataclasses import dataclass, field

from trn_accum.core.strategy import GATHERS, REDUCE_DTYPES
from trn_accum.core.strategy import LOOPS as ACCUM_LOOPS
from trn_accum.core.strategy import REDUCES as GRAD_REDUCTIONS
from trn_accum.data.datasets import DATA_KINDS
from trn_accum.model.fuji import RULES, ModelConfig
from trn_accum.neuron.platform import DEVICE_BUDGET_GIB

# the trainer's loss gathers per minibatch itself (`train.step.strategy` picks "in_loss")
TRAINER_GATHERS = tuple(g for g in GATHERS if g != "in_loss")

SHARDING_RULE_SETS = tuple(RULES)
# [optimizer] kind: what `trn_accum.train.optim.make_optimizer` builds for each
OPTIMIZER_KINDS = ("reference", "adamw")
# seeds feed jax.random.key (32 bits are kept on the default PRNG) and numpy's SeedSequence
# (which refuses negatives): one range for both
MAX_SEED = 2**32 - 1


def _choice(*allowed: str) -> dict:
    return {"choices": allowed}


@dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (one may be -1: all remaining devices) and the sharding rule set."""

    data: int = -1
    fsdp: int = 1
    model: int = 1
    rules: str = field(default="fsdp", metadata=_choice(*SHARDING_RULE_SETS))
    nodes: int = 1  # the node count the global batch is meant for (dry-run default)

    def axes(self) -> dict[str, int]:
        """{"data": ..., "fsdp": ..., "model": ...} for `trn_accum.build_mesh`."""
        return {"data": self.data, "fsdp": self.fsdp, "model": self.model}


@dataclass(frozen=True)
class DataConfig:
    kind: str = field(default="synthetic", metadata=_choice(*DATA_KINDS))
    # kind = "tokens": a prepared directory, a glob of shard directories, or a list of those;
    # "megatron": the PREFIX of PREFIX.bin/.idx; "hf": a save_to_disk directory
    path: str | list[str] = ""
    # kind = "mixture": [{path = ..., weight = 0.5, kind = "tokens"|"megatron"|"hf"}, ...]
    mixture: list[dict] = field(default_factory=list)
    seq_len: int = 8192
    global_batch: int = 2048  # sequences per optimizer step, over all devices and minibatches
    seed: int = 0
    eval_batches: int = 2  # held-out batches per evaluation


@dataclass(frozen=True)
class OptimizerConfig:
    """Clip by global norm, AdamW, linear warmup then cosine decay (`trn_accum.train.optim`).

    kind "reference": decoupled decay, update = -eta(t) * (peak_lr * adam(g) + weight_decay *
    theta) with eta(t) peaking at 1.0. kind "adamw": `optax.adamw(peak_lr * eta(t), ...)`.
    decay_steps counts from step 0 (warmup included); the schedule ends at final_lr_fraction.
    """

    kind: str = field(default="reference", metadata=_choice(*OPTIMIZER_KINDS))
    peak_lr: float = 3e-4
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # clip by global norm; 0 = no clipping
    warmup_steps: int = 2000
    decay_steps: int = 983040
    final_lr_fraction: float = 0.1


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 100
    accum_steps: int | str = 1  # an int >= 1, or "auto" (smallest that fits memory_budget_gib)
    loop: str = field(default="scan", metadata=_choice(*ACCUM_LOOPS))  # minibatch loop
    # "auto": chosen by the settings search before the step is built (trn_accum.plan.settings)
    reduce: str = field(default="per_minibatch", metadata=_choice(*GRAD_REDUCTIONS, "auto"))
    # FSDP weights: gathered in every minibatch (each layer's, by the loss: under reduce "once"
    # its Strategy's gather is "in_loss"), or once per step (needs reduce "once";
    # trn_accum.core.gather_once): "once" reduce-scatters each minibatch's gradient,
    # "once_unsharded" accumulates it full-size and reduce-scatters once
    gather: str = field(default="per_minibatch", metadata=_choice(*TRAINER_GATHERS))
    # the dtype of reduce "once"'s one cross-replica gradient reduction per step: "bfloat16"
    # casts the float32 accumulated gradient down for the psum (and gather "once_unsharded"'s
    # reduce-scatter) and back: half the bytes, bf16 rounding (needs reduce "once")
    reduce_dtype: str = field(default="float32", metadata=_choice(*REDUCE_DTYPES))
    log_every: int = 10
    eval_every: int = 0  # 0 = never
    seed: int = 0  # parameter init and per-step RNG
    memory_budget_gib: float = DEVICE_BUDGET_GIB  # per device, for accum_steps = "auto"
    # stop (exit 2) when this many steps in a row (all of them in a shorter run) were skipped
    # as non-finite; 0 = never stop
    stop_after_nonfinite: int = 100
    # drop a minibatch whose loss or gradient is not finite and keep the step (the metric
    # dropped_minibatches); off by default: on XLA:CPU the finiteness test makes the
    # partitioner all-reduce the FSDP gradient partials in bf16 instead of float32 (README)
    skip_nonfinite: bool = False
    # end the run (exit 2) once more than this fraction of its steps so far were skipped as
    # non-finite (checked from the first log_every steps on, and at the end); 1 = never
    max_skipped_fraction: float = 0.5


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between saves; 0 = only on preemption and at the end
    keep: int = 3  # newest checkpoints kept


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
}
