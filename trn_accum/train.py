"""The trainer: train state, the jitted step (explicit shardings, donated state), the loop.

State (a dict, so checkpoints are plain trees)::

    {"step": int32[],        optimizer steps taken (applied or skipped); the next batch index
     "skipped": int32[],     steps whose gradients were not finite (params/opt state kept)
     "params": fuji params,  float32, sharded by `fuji.param_specs(cfg.model, cfg.mesh.rules)`
     "opt_state": optax,     mu/nu sharded like the params, counts replicated}

One step: the global batch [B, S] (sharded P(("data", "fsdp"), None)) goes through
`accumulate_gradients` (k = trainer.accum_steps strided minibatches, each weighted by its number
of target tokens, so the result equals the full-batch gradient), then the optax update of
`trn_accum.optim` behind a non-finite guard (a `jnp.where` select, no conditional). The step is
jitted with in/out shardings stated and the state donated, and traced and run under
`jax.set_mesh(mesh)` so the model's activation constraints apply.

The batch of step s depends only on (data seed, s): a resumed run sees the batches it would
have seen, so resuming from a checkpoint reproduces an uninterrupted run bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import data as data_lib
from trn_accum import optim
from trn_accum.accumulation import accumulate_gradients
from trn_accum.config import Config, config_to_dict, load_config
from trn_accum.metrics import MetricsLogger, truncate_metrics
from trn_accum.model import fuji
from trn_accum.sharding import build_mesh, split_minibatches

BATCH_AXES = ("data", "fsdp")
BATCH_SPEC = P(BATCH_AXES)  # leaves [B, S]: rows over the batch axes, sequence replicated
AUX_REDUCTION = {"per_example_loss": "concat", "num_target_tokens": "sum"}


class TrainError(ValueError):
    """A user-caused trainer problem (mesh vs devices, batch vs shards, run dir): one line."""


# ---------------------------------------------------------------------------------------------
# Pieces (pure functions of the config; the dry-run uses the same ones)


def make_mesh(cfg: Config, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """The mesh of `cfg.mesh` over `devices` (default: all). TrainError if they do not fit."""
    devices = list(jax.devices() if devices is None else devices)
    axes = cfg.mesh.axes()
    fixed = math.prod(s for s in axes.values() if s != -1)
    more = "run on more devices"
    if devices and devices[0].platform == "cpu":
        more = f"emulate them: XLA_FLAGS=--xla_force_host_platform_device_count={fixed}"
    if fixed > len(devices) or len(devices) % fixed:
        raise TrainError(
            f"mesh {axes} needs a multiple of {fixed} devices but {len(devices)} are available: "
            f"lower mesh sizes (e.g. --set mesh.fsdp=...) or {more}"
        )
    if -1 not in axes.values() and fixed != len(devices):
        raise TrainError(
            f"mesh {axes} uses {fixed} devices but {len(devices)} are available: set one axis "
            f"to -1 (all remaining devices) or match the device count"
        )
    try:
        return build_mesh(axes, devices)
    except ValueError as e:
        raise TrainError(f"mesh {axes} on {len(devices)} devices: {e}") from None


def batch_shards(mesh: jax.sharding.Mesh) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def check_batch(cfg: Config, mesh: jax.sharding.Mesh, global_batch: int | None = None) -> int:
    """Returns k; TrainError unless the global batch divides by k x batch shards."""
    k = cfg.trainer.accum_steps
    if not isinstance(k, int):
        raise TrainError(
            f"trainer.accum_steps = {k!r}: the trainer needs an integer; pick one with "
            f"`trn-accum dry-run` and set it with --set trainer.accum_steps=K"
        )
    b = cfg.data.global_batch if global_batch is None else global_batch
    shards = batch_shards(mesh)
    if b % (k * shards):
        valid = [j for j in range(1, b + 1) if b % (j * shards) == 0]
        hint = (
            f"valid accum_steps: {valid[:8]}" if valid else "change data.global_batch or the mesh"
        )
        raise TrainError(
            f"data.global_batch = {b} is not divisible by accum_steps ({k}) x batch shards "
            f"(data x fsdp = {shards}) = {k * shards}: {hint}"
        )
    return k


def check_attention(cfg: Config) -> None:
    """TrainError now (not a traceback at trace time) when "neuron_flash" has no kernels here."""
    if cfg.model.attention == "neuron_flash":
        from trn_accum.model import attention  # noqa: PLC0415

        try:
            attention.load_nki_flash_kernels()
        except ValueError as e:
            raise TrainError(str(e)) from None


def resolve_accum_steps(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Config, Any]:
    """(cfg with trainer.accum_steps = "auto" replaced by the smallest k whose compiled step fits
    trainer.memory_budget_gib per device, the `trn_accum.autotune.AutotuneResult`); (cfg, None)
    when k is given. TrainError if no k fits."""
    if cfg.trainer.accum_steps != "auto":
        return cfg, None
    from trn_accum import autotune  # noqa: PLC0415

    # Every process must pick the same k: compiled bytes agree everywhere, a choice of depth
    # by measured compile time ("auto") might not.
    depth = "auto" if jax.process_count() == 1 else "extrapolate"
    try:
        return autotune.resolve_accum_steps(cfg, mesh, depth=depth)
    except autotune.AutotuneError as e:
        raise TrainError(str(e)) from None


def make_optimizer(cfg: Config):
    """(tx, lr_fn) from cfg.optimizer; lr_fn(count) = peak_lr * eta(count)."""
    o = cfg.optimizer
    return optim.make_optimizer(
        kind=o.kind,
        learning_rate=o.peak_lr,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        clip_norm=o.clip_norm,
        warmup_steps=o.warmup_steps,
        total_steps=o.decay_steps,
        end_fraction=o.final_lr_fraction,
    )


def param_specs(cfg: Config, mesh: jax.sharding.Mesh):
    try:
        return fuji.param_specs(cfg.model, cfg.mesh.rules, dict(mesh.shape))
    except ValueError as e:
        raise TrainError(str(e)) from None


def init_state(cfg: Config, tx: optax.GradientTransformation, key) -> dict:
    params = fuji.init_params(cfg.model, key)
    return {
        "step": jnp.zeros((), jnp.int32),
        "skipped": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
    }


def abstract_state(cfg: Config, tx: optax.GradientTransformation) -> dict:
    """The state as ShapeDtypeStructs (`jax.eval_shape`: no memory, works for 3B)."""
    return jax.eval_shape(lambda: init_state(cfg, tx, jax.random.key(cfg.trainer.seed)))


def state_specs(tx: optax.GradientTransformation, abstract: dict, specs) -> dict:
    """PartitionSpecs of the state: optimizer leaves shaped like params take the param's spec,
    the rest (counts) are replicated."""
    opt_specs = optax.tree_utils.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract["opt_state"],
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    return {"step": P(), "skipped": P(), "params": specs, "opt_state": opt_specs}


def named(mesh: jax.sharding.Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh, global_batch: int | None = None):
    b = cfg.data.global_batch if global_batch is None else global_batch
    shape, sh = (b, cfg.data.seq_len), batch_sharding(mesh)
    return {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "target_labels": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "target_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
    }


def _loss(cfg: Config):
    def loss(params, batch):
        return fuji.loss_fn(params, batch, cfg.model)

    return loss


def make_train_step(cfg: Config, mesh, tx, lr_fn, specs, state_shardings):
    """jit(step)(state, batch) -> (state, metrics); state donated, shardings explicit."""
    k = cfg.trainer.accum_steps
    grad_fn = accumulate_gradients(
        _loss(cfg),
        steps=k,
        mesh=mesh,
        batch_spec=BATCH_SPEC,
        param_specs=specs,
        weight_fn=lambda mb: mb["target_mask"].sum(),
        has_aux=True,
        aux_reduction=AUX_REDUCTION,
        loop=cfg.trainer.loop,
        reduce=cfg.trainer.reduce,
    )

    def step(state, batch):
        (loss, aux), grads = grad_fn(state["params"], batch)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        lr = lr_fn(state["step"] - state["skipped"])  # the schedule counts applied updates
        params, opt_state, applied = optim.guarded_update(
            tx, grads, state["opt_state"], state["params"], finite=finite
        )
        new = {
            "step": state["step"] + 1,
            "skipped": state["skipped"] + jnp.where(applied, 0, 1).astype(jnp.int32),
            "params": params,
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(lr, jnp.float32),
            "target_tokens": aux["num_target_tokens"],
            "skipped_steps": new["skipped"],
        }
        return new, metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def make_eval_step(cfg: Config, mesh, param_shardings):
    """jit(eval)(params, batch) -> (sum of per-token losses, number of target tokens), run over
    the same k minibatches as training (same memory), with a fixed-length scan."""
    k = cfg.trainer.accum_steps
    loss = _loss(cfg)

    def ev(params, batch):
        stacked = split_minibatches(batch, k, mesh=mesh, batch_spec=BATCH_SPEC)

        def body(carry, mb):
            value, aux = loss(params, mb)
            n = aux["num_target_tokens"]
            return (carry[0] + value * n, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (total, count), _ = jax.lax.scan(body, (zero, zero), stacked)
        return total, count

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        ev,
        in_shardings=(param_shardings, batch_sharding(mesh)),
        out_shardings=(replicated, replicated),
    )


def flops_per_step(cfg: Config, global_batch: int | None = None) -> dict[str, float]:
    """Analytic training FLOPs of one optimizer step (forward + backward, no remat recompute).

    dense = 6 * N * tokens (N counts the tied embedding once: the LM head matmul uses it);
    attention = 6 * L * H * Dh * S per token (QK^T and PV, causal: half of the 12 L H Dh S of
    non-causal attention).
    """
    m = cfg.model
    b = cfg.data.global_batch if global_batch is None else global_batch
    s = cfg.data.seq_len
    tokens = b * s
    n = fuji.num_params(m)
    dense = 6.0 * n * tokens
    attn = 6.0 * m.num_layers * m.num_heads * m.head_dim * s * tokens
    return {"params": n, "tokens": tokens, "dense": dense, "attention": attn, "total": dense + attn}


# ---------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class Trainer:
    """Everything built from a config on the current devices."""

    cfg: Config
    mesh: jax.sharding.Mesh
    tx: optax.GradientTransformation
    lr_fn: Any
    specs: Any
    abstract: dict
    state_shardings: dict
    step_fn: Any
    eval_fn: Any
    dataset: Any
    autotune: Any = None  # the AutotuneResult when trainer.accum_steps was "auto"

    @classmethod
    def build(cls, cfg: Config, devices=None) -> Trainer:
        check_attention(cfg)
        mesh = make_mesh(cfg, devices)
        cfg, tuned = resolve_accum_steps(cfg, mesh)
        check_batch(cfg, mesh)
        tx, lr_fn = make_optimizer(cfg)
        specs = param_specs(cfg, mesh)
        abstract = abstract_state(cfg, tx)
        shardings = named(mesh, state_specs(tx, abstract, specs))
        dataset = data_lib.make_dataset(
            cfg.data.kind,
            seq_len=cfg.data.seq_len,
            batch_size=cfg.data.global_batch,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.data.seed,
            path=cfg.data.path or None,
            max_seq_len=cfg.model.max_seq_len,
        )
        return cls(
            cfg=cfg,
            mesh=mesh,
            tx=tx,
            lr_fn=lr_fn,
            specs=specs,
            abstract=abstract,
            state_shardings=shardings,
            step_fn=make_train_step(cfg, mesh, tx, lr_fn, specs, shardings),
            eval_fn=make_eval_step(cfg, mesh, shardings["params"]),
            dataset=dataset,
            autotune=tuned,
        )

    @functools.cached_property
    def _init_fn(self):
        seed = self.cfg.trainer.seed
        return jax.jit(
            lambda: init_state(self.cfg, self.tx, jax.random.key(seed)),
            out_shardings=self.state_shardings,
        )

    def init(self) -> dict:
        """A fresh state (params from trainer.seed), created directly in its shardings."""
        with jax.set_mesh(self.mesh):
            return self._init_fn()

    def batch(self, step: int, split: str = "train") -> dict:
        return data_lib.global_batch(
            self.dataset, step, self.cfg.data.global_batch, batch_sharding(self.mesh), split
        )

    @functools.cached_property
    def compiled_step(self):
        """The train step lowered from abstract inputs (state and batch shardings as stated)
        and compiled once; called as `compiled_step(state, batch)`."""
        state = restore_target(self.abstract, self.state_shardings)
        batch = abstract_batch(self.cfg, self.mesh)
        with jax.set_mesh(self.mesh):
            return self.step_fn.lower(state, batch).compile()

    def step(self, state: dict, batch: dict):
        """One optimizer step: (state, batch) -> (new state, metrics); `state` is donated."""
        return self.compiled_step(state, batch)

    def evaluate(self, params) -> float:
        """Mean loss over target tokens of the `data.eval_batches` held-out batches 0..n-1."""
        total = count = 0.0
        for i in range(self.cfg.data.eval_batches):
            with jax.set_mesh(self.mesh):
                t, c = self.eval_fn(params, self.batch(i, "eval"))
            total += float(t)
            count += float(c)
        return total / count if count else 0.0


def _prepare_run_dir(run_dir: str) -> None:
    from trn_accum.checkpoint import make_writable_dir  # noqa: PLC0415

    try:
        make_writable_dir(run_dir)
    except OSError as e:
        raise TrainError(
            f"run dir {run_dir!r} is not writable ({e.strerror}): pass --run-dir with a "
            f"writable directory"
        ) from None


def _initialize_distributed() -> None:
    """jax.distributed from Slurm / Kubernetes / explicit env (single process: nothing), and
    the Neuron env + rbg PRNG on trn2; before any JAX computation."""
    from trn_accum import distributed  # noqa: PLC0415

    distributed.initialize()


def _fault(kind: str) -> int | None:
    """Fault injection for the tests: TRN_ACCUM_TEST_FAULT="<kind>=<step>[,...]" (else None).

    kinds: "sigterm_after_step" (the process sends itself SIGTERM after that step: the real
    preemption path), "sigkill_after_save_start" (SIGKILL right after a background save of
    that step has started, before it commits).
    """
    for item in os.environ.get("TRN_ACCUM_TEST_FAULT", "").split(","):
        name, _, step = item.strip().partition("=")
        if name == kind and step.isdigit():
            return int(step)
    return None


def _peak_flops() -> float | None:
    from trn_accum import neuron  # noqa: PLC0415

    peak = neuron.peak_flops_per_device()
    return float(peak) if peak else None


def restore_target(abstract: dict, shardings: dict) -> dict:
    """ShapeDtypeStructs with the current mesh's shardings: orbax restores straight into them."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def run(
    config_path: str,
    *,
    overrides: Sequence[str] = (),
    run_dir: str,
    profile: tuple[int, int] | None = None,
    console=None,
) -> int:
    """Train (or resume) the run in `run_dir`. Returns 0, or EXIT_PREEMPTED after a save.

    `run_dir` holds `checkpoints/` (orbax; the newest committed one is resumed automatically),
    `metrics.jsonl`, `config.json` and, with `profile=(start, stop)`, `profile/` (a
    jax.profiler trace of the steps numbered start..stop-1, numbered as logged: from 1).
    """
    from trn_accum.checkpoint import Preemption  # noqa: PLC0415

    cfg = load_config(config_path, overrides)
    # jax.distributed first: in a multi-process run it installs JAX's own SIGTERM notifier,
    # which would replace our handler if it came after it (then SIGTERM saves nothing).
    _initialize_distributed()
    # SIGTERM/SIGINT only set a flag from here on (restore and compile can take minutes on
    # trn2); the loop turns it into a save and EXIT_PREEMPTED.
    with Preemption() as pre:
        return _run(cfg, pre, run_dir=run_dir, profile=profile, console=console)


def _run(cfg: Config, pre, *, run_dir: str, profile, console) -> int:
    from trn_accum.checkpoint import Checkpointer  # noqa: PLC0415

    _prepare_run_dir(run_dir)
    trainer = Trainer.build(cfg)
    cfg = trainer.cfg  # accum_steps = "auto" resolved
    main = jax.process_index() == 0
    total = cfg.trainer.steps

    with Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        save_every=cfg.checkpoint.every,
        keep=cfg.checkpoint.keep,
    ) as ckpt:
        latest = ckpt.latest_step()
        if latest is not None:
            state, _ = ckpt.restore(restore_target(trainer.abstract, trainer.state_shardings))
            start = int(state["step"])
        else:
            state, start = trainer.init(), 0
        if main and start < total:
            truncate_metrics(run_dir, start)
            with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config_to_dict(cfg), f, indent=2)
        with MetricsLogger(
            run_dir,
            total_steps=total,
            log_every=cfg.trainer.log_every,
            enabled=main,
            console=console,
        ) as logger:
            if trainer.autotune is not None:
                logger.message(trainer.autotune.format())
            if latest is not None:
                logger.message(f"resumed from {ckpt.step_path(latest)} (step {start})")
            if start >= total:
                logger.message(f"already at step {start} of {total}: nothing to do")
                return 0
            logger.message(
                f"training {fuji.num_params(cfg.model):,} parameters on {jax.device_count()} "
                f"{jax.default_backend()} devices, mesh {dict(trainer.mesh.shape)}, batch "
                f"{cfg.data.global_batch} x {cfg.data.seq_len} in {cfg.trainer.accum_steps} "
                f"minibatches, steps {start + 1}..{total}"
            )
            return _loop(trainer, state, start, ckpt, logger, run_dir, profile, pre)


def _loop(trainer: Trainer, state, start: int, ckpt, logger, run_dir: str, profile, pre) -> int:
    from trn_accum.checkpoint import EXIT_PREEMPTED  # noqa: PLC0415

    cfg = trainer.cfg
    total = cfg.trainer.steps
    flops = flops_per_step(cfg)["total"]
    peak = _peak_flops()
    n_dev = jax.device_count()
    tokens = cfg.data.global_batch * cfg.data.seq_len
    meta = {"config": config_to_dict(cfg)}
    sigterm_at, kill_at = _fault("sigterm_after_step"), _fault("sigkill_after_save_start")

    t0 = time.perf_counter()
    compiled = trainer.compiled_step
    logger.message(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    batch = trainer.batch(start)
    if pre.should_stop(start):  # signalled before the first step: the checkpoint is current
        logger.message(
            f"preempted (signal {pre.received}) before step {start + 1}: nothing new to save; "
            f"exit {EXIT_PREEMPTED}"
        )
        return EXIT_PREEMPTED

    tracing = False
    t_prev = time.perf_counter()
    for s in range(start, total):
        if profile and s + 1 == profile[0]:  # profile = (START, STOP) in logged step numbers
            jax.profiler.start_trace(os.path.join(run_dir, "profile"))
            tracing = True
        state, m = compiled(state, batch)
        done = s + 1
        if done < total:
            batch = trainer.batch(done)  # host work while the device runs the step
        m = jax.device_get(m)
        now = time.perf_counter()
        dt = now - t_prev
        if tracing and (done + 1 >= profile[1] or done == total):
            jax.profiler.stop_trace()
            tracing = False
        record = {
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            "skipped_steps": int(m["skipped_steps"]),
            "target_tokens": float(m["target_tokens"]),
        }
        if peak:
            record["mfu"] = flops / dt / (peak * n_dev)
        logger.log_train(done, record)
        if cfg.trainer.eval_every and done % cfg.trainer.eval_every == 0:
            logger.log_eval(done, {"eval_loss": trainer.evaluate(state["params"])})
        if sigterm_at == done:
            os.kill(os.getpid(), signal.SIGTERM)
        if pre.should_stop(done):
            ckpt.save(done, state, metadata=meta, force=True)
            ckpt.wait_until_finished()
            logger.message(
                f"preempted (signal {pre.received}): saved {ckpt.step_path(done)}; exit "
                f"{EXIT_PREEMPTED}, run the same command again to resume"
            )
            return EXIT_PREEMPTED
        if done < total and ckpt.save(done, state, metadata=meta) and kill_at == done:
            os.kill(os.getpid(), signal.SIGKILL)
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
    if tracing:
        jax.profiler.stop_trace()
    ckpt.save(total, state, metadata=meta, force=True)
    ckpt.wait_until_finished()
    logger.message(f"done: step {total}, checkpoint {ckpt.step_path(total)}")
    return 0
