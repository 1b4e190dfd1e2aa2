"""What a run builds from its config on the current devices: the `Trainer` (the compiled train
step and its shardings, the eval step, the dataset, the settings search's result).

    trainer = Trainer.build(cfg)           # mesh, the compiled step, the data
    trainer = Trainer.build(cfg, settings=resolve)  # "auto" settings chosen on the mesh first
    state = trainer.init()                 # or restored from the newest checkpoint
    state, metrics = trainer.step(state, trainer.batch(i))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from trn_accum.config import drift, mesh_rules
from trn_accum.config.auto import auto_keys
from trn_accum.config.load import Config, config_to_dict
from trn_accum.data import datasets as data_lib
from trn_accum.neuron import lowering
from trn_accum.train import step

# (config, mesh) -> (config with every "auto" chosen, the search's result for the log). The
# search lives above the trainer (`trn_accum.plan`): its caller hands it in.
Settings = Callable[[Config, jax.sharding.Mesh], tuple[Config, Any]]


@dataclasses.dataclass
class Trainer:
    """Everything built from a config on the current devices."""

    program: step.StepProgram  # the compiled train step and its shardings
    eval_fn: Any
    dataset: Any
    settings: Any = None  # the settings search's Resolution (its `line()` is logged)

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
    def build(cls, cfg: Config, devices=None, settings: Settings | None = None) -> Trainer:
        """`settings` chooses every "auto" of `cfg` on the mesh (`trn_accum.plan.settings_run`);
        without it, a config with one is refused (TrainError, naming the keys)."""
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
            mixture=cfg.data.mixture,
        )
        cfg, tuned = settings(cfg, mesh) if settings is not None else (cfg, None)
        if auto_keys(cfg):
            raise mesh_rules.TrainError(
                f'{", ".join(auto_keys(cfg))} = "auto" is chosen by the settings search, '
                f"which this caller did not run: run `trn-accum train`, or pass "
                f"settings=trn_accum.plan.settings_run.for_run to Trainer.build"
            )
        program = step.build_step(cfg, mesh)
        return cls(
            program=program,
            eval_fn=step.make_eval_step(cfg, mesh, program.state_shardings["params"]),
            dataset=dataset,
            settings=tuned,
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
