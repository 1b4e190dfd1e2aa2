"""The probe of `trn-accum neuron-check`: the config's model pieces at a size that compiles in
seconds, on a mesh over the job's devices, and one real train step of it."""

from __future__ import annotations

import dataclasses

import jax

from trn_accum.config.load import Config, TrainerConfig


class Check:
    """What the rows share: the config, the devices and the probe model derived from them."""

    def __init__(self, cfg: Config, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.devices = jax.local_devices()  # this process's (64 per trn2.48xlarge)
        self.job_devices = jax.devices()  # every process's: the train-step rows use them all
        self.on_neuron = jax.default_backend() == "neuron"
        self._steps: dict[str, dict] = {}  # train_step's results by config

    # -------------------------------------------------------------------- the probe config

    def probe(self, *, data: int = 1, **trainer) -> Config:
        """The config's model pieces (attention, remat, head_dim, GQA ratio, mesh rules) at a
        size that compiles in seconds, float32, on a mesh over the job's devices (every
        process's, so a multi-node check runs the real cross-node step): the config's model
        axis, `data` (when it divides) and fsdp the rest."""
        c, n = self.cfg, len(self.job_devices)
        model_axis = c.mesh.model if c.mesh.model > 0 and n % c.mesh.model == 0 else 1
        data = data if (n // model_axis) % data == 0 else 1
        fsdp = n // model_axis // data
        group = max(1, c.model.num_heads // max(1, c.model.num_kv_heads))
        seq, block = 256, c.model.attention_block
        m = dataclasses.replace(
            c.model,
            vocab_size=1024,
            num_layers=2,
            hidden_dim=256,
            num_kv_heads=model_axis,
            num_heads=model_axis * group,
            ffn_dim=512,
            max_seq_len=seq,
            compute_dtype="float32",
            layer_loop="scan",
            attention_block=128 if block == "auto" else min(block, 128),
            loss_chunk=min(c.model.loss_chunk, seq) if c.model.loss_chunk not in (0, "auto") else 0,
            # "auto" (chosen by the settings search at train time) probes as no remat (the
            # numerics row then compares "full"), blockwise attention and the whole loss
            remat="none" if c.model.remat == "auto" else c.model.remat,
            attention="blockwise" if c.model.attention == "auto" else c.model.attention,
        )
        mesh = dataclasses.replace(c.mesh, data=data, fsdp=fsdp, model=model_axis, nodes=1)
        shards = n // model_axis
        data_cfg = dataclasses.replace(
            c.data, kind="synthetic", seq_len=seq, global_batch=shards * 4, path=""
        )
        # the options a row compares are reset to their defaults (a row names the ones it
        # tests), the rest kept
        defaults = TrainerConfig()
        base = {
            k: getattr(defaults, k) for k in ("accum_steps", "reduce", "gather", "reduce_dtype")
        }
        t = dataclasses.replace(c.trainer, **{**base, **trainer})
        return dataclasses.replace(c, model=m, mesh=mesh, data=data_cfg, trainer=t)

    def train_step(self, cfg: Config) -> dict:
        """One real train step of `cfg` from its initial state: the metrics as floats. Run once
        per config: rows that compare against the same program share it (reduce-once's "once"
        in float32 is gather-once's reference): one compile fewer, minutes under neuronx-cc."""
        key = repr(cfg)
        if key not in self._steps:
            from trn_accum.train.trainer import Trainer

            trainer = Trainer.build(cfg, self.job_devices)
            _, metrics = trainer.step(trainer.init(), trainer.batch(0))
            self._steps[key] = {k: float(v) for k, v in jax.device_get(metrics).items()}
        return self._steps[key]
