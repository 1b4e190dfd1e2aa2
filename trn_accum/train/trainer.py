"""What a run builds from its config on the current devices: the `Trainer` (the compiled train
step and its shardings, the eval step, the dataset, the auto-k result).

    trainer = Trainer.build(cfg)           # mesh, accum_steps, the compiled step, the data
    state = trainer.init()                 # or restored from the newest checkpoint
    state, metrics = trainer.step(state, trainer.batch(i))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from trn_accum.neuron import lowering
from trn_accum.train import autosettings, drift, mesh_rules, step
from trn_accum.train import data as data_lib
from trn_accum.train.config import Config, config_to_dict


def resolve_accum_steps(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Config, Any]:
    """(cfg with each "auto" of trainer.accum_steps, model.remat and model.loss_chunk replaced
    by what fits trainer.memory_budget_gib per device, the search's result); (cfg, None) when
    none is "auto" (`trn_accum.train.autosettings`)."""
    # Every process must pick the same k: compiled bytes agree everywhere, a choice of depth
    # by measured compile time ("auto") might not.
    depth = "auto" if jax.process_count() == 1 else "extrapolate"
    return autosettings.resolve(cfg, mesh, depth=depth)


@dataclasses.dataclass
class Trainer:
    """Everything built from a config on the current devices."""

    program: step.StepProgram  # the compiled train step and its shardings
    eval_fn: Any
    dataset: Any
    autotune: Any = None  # the AutotuneResult when trainer.accum_steps was "auto"

    @property
    def cfg(self) -> Config:
        return self.program.cfg

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.program.mesh

    @property
    def state_shardings(self) -> dict:
        return self.program.state_shardings

    @functools.cached_property
    def record(self) -> dict:
        """The run record: the config and the data's fingerprint (`drift.run_record`)."""
        fp = self.dataset.fingerprint if hasattr(self.dataset, "fingerprint") else None
        return drift.run_record(config_to_dict(self.cfg), fp)

    @classmethod
    def build(cls, cfg: Config, devices=None) -> Trainer:
        mesh_rules.check_start(cfg, devices)  # what `trn-accum check-config` checks, the same call
        mesh = mesh_rules.make_mesh(cfg, devices)
        if mesh.devices.flat[0].platform == "neuron":  # remat's identity rounding, not lowered
            lowering.drop_identity_reduce_precision("neuron")
        # The data first: a bad data path or file is reported before anything compiles.
        dataset = data_lib.make_dataset(
            cfg.data.kind,
            seq_len=cfg.data.seq_len,
            batch_size=cfg.data.global_batch,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.data.seed,
            path=cfg.data.path or None,
            max_seq_len=cfg.model.max_seq_len,
        )
        cfg, tuned = resolve_accum_steps(cfg, mesh)
        program = step.build_step(cfg, mesh)
        return cls(
            program=program,
            eval_fn=step.make_eval_step(cfg, mesh, program.state_shardings["params"]),
            dataset=dataset,
            autotune=tuned,
        )

    @functools.cached_property
    def _init_fn(self):
        seed = self.cfg.trainer.seed
        return jax.jit(
            lambda: step.init_state(self.cfg, self.program.tx, jax.random.key(seed)),
            out_shardings=self.state_shardings,
        )

    def init(self) -> dict:
        """A fresh state (params from trainer.seed), created directly in its shardings."""
        with jax.set_mesh(self.mesh):
            return self._init_fn()

    def batch(self, index: int, split: str = "train") -> dict:
        """The global batch of step `index` (0-based), each process building only its rows."""
        return data_lib.global_batch(
            self.dataset, index, self.cfg.data.global_batch, step.batch_sharding(self.mesh), split
        )

    def step(self, state: dict, batch: dict):
        """One optimizer step: (state, batch) -> (new state, metrics); `state` is donated."""
        return self.program.compiled(state, batch)

    def restore_target(self) -> dict:
        """The state as ShapeDtypeStructs with this mesh's shardings (orbax restores into it)."""
        return step.restore_target(self.program.abstract, self.state_shardings)

    def evaluate(self, params) -> float:
        """Mean loss over target tokens of the `data.eval_batches` held-out batches 0..n-1."""
        total = count = 0.0
        for i in range(self.cfg.data.eval_batches):
            with jax.set_mesh(self.mesh):
                t, c = self.eval_fn(params, self.batch(i, "eval"))
            total += float(t)
            count += float(c)
        return total / count if count else 0.0
