"""The training run: `run(config, run_dir)` trains or resumes, saves on preemption, logs.

    trainer = Trainer.build(cfg)           # mesh, accum_steps, the compiled step, the data
    state = trainer.init()                 # or restored from the newest checkpoint
    state, metrics = trainer.program.compiled(state, trainer.batch(i))

The batch of step s depends only on (data seed, s): a resumed run sees the batches it would
have seen, so resuming from a checkpoint reproduces an uninterrupted run bit for bit.
SIGTERM/SIGINT set a flag (`trn_accum.train.preemption.Preemption`); all processes agree on a
step, save it, and exit `EXIT_PREEMPTED`.

The run dir is claimed for this job before anything in it is written, and the config is
checked against the one the resumed checkpoint was trained with (`trn_accum.train.rundir`,
`trn_accum.train.drift`).
At every step boundary the processes agree, in one all-gather, on whether to stop: a signal
(save, exit 75), a background checkpoint save that failed (exit 74, previous checkpoint
intact), a lost claim, or the last `trainer.stop_after_nonfinite` steps (all of them in a
shorter run) skipped as non-finite (exit 2), or more than `trainer.max_skipped_fraction` of
the run's steps skipped, judged every `log_every` steps and at the last (exit 2). A skipped
step is a warning on the console, at most one per `log_every` steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from trn_accum.cluster import distributed
from trn_accum.errors import EXIT_PREEMPTED, EXIT_SAVE_FAILED, UserError
from trn_accum.model import fuji
from trn_accum.neuron import platform
from trn_accum.train import autok, drift, rundir, step
from trn_accum.train import data as data_lib
from trn_accum.train.checkpoint import Checkpointer, CheckpointError, make_writable_dir
from trn_accum.train.config import Config, config_to_dict, load_config
from trn_accum.train.metrics import (
    MetricsError,
    MetricsLogger,
    console_width,
    fit_text,
    read_metrics,
    trailing_skipped,
    truncate_metrics,
)
from trn_accum.train.preemption import Preemption, exit_now_if_abandoned, run_unless_signalled


def resolve_accum_steps(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Config, Any]:
    """(cfg with trainer.accum_steps = "auto" replaced by the smallest k whose compiled step fits
    trainer.memory_budget_gib per device, the AutotuneResult); (cfg, None) when k is given."""
    # Every process must pick the same k: compiled bytes agree everywhere, a choice of depth
    # by measured compile time ("auto") might not.
    depth = "auto" if jax.process_count() == 1 else "extrapolate"
    return autok.resolve_accum_steps(cfg, mesh, depth=depth)


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
        step.check_start(cfg, devices)  # what `trn-accum check-config` checks, the same call
        mesh = step.make_mesh(cfg, devices)
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


def _prepare_run_dir(run_dir: str) -> None:
    path = os.path.abspath(run_dir)
    try:  # a byte that is not UTF-8 reaches Python as a lone surrogate (PEP 383)
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = path[e.start].encode("utf-8", "surrogateescape")
        raise step.TrainError(
            f"run dir {os.fsencode(path)!r} has the byte {bad!r}, which is not UTF-8: the "
            f"checkpoint library (orbax over tensorstore) stores paths as UTF-8 and cannot save "
            f"there; pass a --run-dir whose path is UTF-8"
        ) from None
    try:
        make_writable_dir(run_dir)
    except OSError as e:
        raise step.TrainError(
            f"run dir {run_dir!r} is not writable ({e.strerror}): pass --run-dir with a "
            f"writable directory"
        ) from None


def run(
    config_path: str,
    *,
    overrides: Sequence[str] = (),
    run_dir: str,
    profile: tuple[int, int] | None = None,
    console=None,
    allow_config_change: Sequence[str] = (),
) -> int:
    """Train (or resume) the run in `run_dir`. Returns 0, or EXIT_PREEMPTED after a save.

    `run_dir` holds `checkpoints/` (orbax; the newest committed one is resumed automatically),
    `metrics.jsonl`, `config.json`, `owner.json` while a trainer runs (`trn_accum.train.rundir`),
    `config_changes.jsonl` once a change of a trajectory key was allowed
    (`allow_config_change`: keys or sections) and, with `profile=(start, stop)`, `profile/` (a
    jax.profiler trace of the steps numbered start..stop-1, numbered as logged: from 1).
    """
    try:
        cfg = load_config(config_path, overrides)
        defaults = drift.run_record(config_to_dict(Config()), None)
        allowed = drift.check_allowed_keys(allow_config_change, defaults)
    except UserError as e:  # the other ranks of a job hear of it instead of waiting for it
        distributed.fail_startup(e)
    # jax.distributed first: in a multi-process run it installs JAX's own SIGTERM notifier,
    # which would replace our handler if it came after it (then SIGTERM saves nothing).
    distributed.initialize()  # Slurm / Kubernetes / explicit env; the Neuron env on trn2
    # SIGTERM/SIGINT only set a flag from here on (restore and compile can take minutes on
    # trn2); the loop turns it into a save and EXIT_PREEMPTED.
    with Preemption() as pre:
        code = _run(cfg, pre, run_dir=run_dir, profile=profile, console=console, allowed=allowed)
    exit_now_if_abandoned(code)  # a compile abandoned to a signal: no interpreter shutdown
    return code


def _config_changes(record: dict, ckpt, at: int, run_dir: str, allowed: set[str], say) -> dict:
    """The allowed changes of the run record (`Trainer.record`) against the one checkpoint `at`
    was trained with; ConfigDriftError for any other."""
    old, where = drift.recorded_config(run_dir, ckpt.read_metadata(at))
    if old is None:
        say(f"warning: no readable record of the run's config ({where}): not checked for drift")
        return {}
    defaults = drift.run_record(config_to_dict(Config()), None)
    changes = drift.trajectory_changes(old, record, defaults)
    drift.check_drift(changes, allowed, run_dir=run_dir, step=at, record=where)
    return changes


def _run(cfg: Config, pre, *, run_dir: str, profile, console, allowed) -> int:
    _prepare_run_dir(run_dir)
    drift.check_same_config(config_to_dict(cfg))  # every rank runs process 0's config
    trainer = Trainer.build(cfg)  # config, mesh and data errors before the run dir is touched
    cfg = trainer.cfg  # accum_steps = "auto" resolved
    main = jax.process_index() == 0
    total = cfg.trainer.steps
    out = console if console is not None else sys.stdout

    def say(text: str) -> None:
        if main:
            print(fit_text(text, console_width()), file=out, flush=True)

    claim = rundir.claim_for_job(run_dir, say=say)
    try:
        with Checkpointer(
            os.path.join(run_dir, "checkpoints"),
            save_every=cfg.checkpoint.every,
            keep=cfg.checkpoint.keep,
        ) as ckpt:
            latest = ckpt.latest_step()
            changes: dict = {}
            if latest is not None:
                changes = _config_changes(trainer.record, ckpt, latest, run_dir, allowed, say)
                state, _ = ckpt.restore(trainer.restore_target(), latest)
                start = int(state["step"])
            else:
                state, start = trainer.init(), 0
            if main and start < total:
                truncate_metrics(run_dir, start)
                text = json.dumps(trainer.record, indent=2)
                rundir.write_atomic(os.path.join(run_dir, drift.CONFIG_FILE), text)
                drift.log_changes(run_dir, start, changes)
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
                if changes and start < total:
                    listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
                    logger.message(
                        f"config changed from step {start} on (allowed): {listed}; logged in "
                        f"{os.path.join(run_dir, drift.CHANGES_FILE)}"
                    )
                if start >= total:
                    logger.message(f"already at step {start} of {total}: nothing to do")
                    return 0
                logger.message(
                    f"training {fuji.num_params(cfg.model):,} parameters on "
                    f"{jax.device_count()} {jax.default_backend()} devices, mesh "
                    f"{dict(trainer.mesh.shape)}, batch {cfg.data.global_batch} x "
                    f"{cfg.data.seq_len} in {cfg.trainer.accum_steps} minibatches, steps "
                    f"{start + 1}..{total}"
                )
                return _loop(trainer, state, start, ckpt, logger, run_dir, profile, pre, claim)
    finally:
        if claim is not None:
            claim.release()


def _data_and_newest(cfg: Config, ckpt) -> tuple[str, str]:
    """(the data a non-finite error names, the newest committed checkpoint or "none yet")."""
    steps = ckpt.committed_steps()
    newest = ckpt.step_path(steps[-1]) if steps else "none yet"
    return (cfg.data.path if cfg.data.kind == "tokens" else "synthetic"), newest


def _nonfinite_error(cfg: Config, done: int, count: int, ckpt) -> step.TrainError:
    data, newest = _data_and_newest(cfg, ckpt)
    return step.TrainError(
        f"step {done}: the last {count} steps ({done - count + 1}..{done}) were all skipped as "
        f"non-finite (loss or gradient norm NaN/inf; trainer.stop_after_nonfinite = "
        f"{cfg.trainer.stop_after_nonfinite}): check optimizer.peak_lr "
        f"({cfg.optimizer.peak_lr}), the data ({data}), model.compute_dtype "
        f"({cfg.model.compute_dtype}) and model.init_std ({cfg.model.init_std}); newest "
        f"checkpoint: {newest}"
    )


MIN_STEPS_JUDGED = 10  # a share of fewer steps says little (one skipped step of two)


def too_many_skipped(skipped: int, done: int, total: int, every: int, fraction: float) -> bool:
    """Whether the run ends here for its non-finite steps: `skipped` of its `done` steps so far
    is more than `fraction` of them, judged at each `every`-th step from MIN_STEPS_JUDGED on
    and at the last (`total`), whatever the run's length. fraction 1 = never."""
    judged = (done % every == 0 and done >= MIN_STEPS_JUDGED) or done == total
    return fraction < 1 and judged and skipped > fraction * done


def _skipped_fraction_error(cfg: Config, done: int, skipped: int, ckpt) -> step.TrainError:
    data, newest = _data_and_newest(cfg, ckpt)
    return step.TrainError(
        f"step {done}: {skipped} of the run's {done} steps ({skipped / done:.0%}) were skipped "
        f"as non-finite (loss or gradient norm NaN/inf), more than "
        f"trainer.max_skipped_fraction = {cfg.trainer.max_skipped_fraction}: the run is not "
        f"learning; suspects: the learning rate (optimizer.peak_lr = {cfg.optimizer.peak_lr}), "
        f"the data ({data}), the precision without loss scaling (model.compute_dtype = "
        f"{cfg.model.compute_dtype}); newest checkpoint: {newest}"
    )


def _check_problems(pre, failure, claim) -> None:
    """Raise for a failed save or a lost claim that some process reported at this boundary."""
    if "save_failed" in pre.problems:
        raise failure or CheckpointError(
            "a checkpoint save failed on another process (see its error): fix the storage, "
            "then run the same command again to resume",
            exit_code=EXIT_SAVE_FAILED,
        )
    if "claim_lost" in pre.problems:
        lost = claim.lost if claim is not None else None
        raise rundir.RunDirError(lost or "process 0 lost the run dir's claim: see its error")


def _loop(trainer: Trainer, state, start: int, ckpt, logger, run_dir, profile, pre, claim) -> int:
    cfg = trainer.cfg
    total = cfg.trainer.steps
    flops = step.flops_per_step(cfg)["total"]
    peak = platform.peak_flops_per_device()
    n_dev = jax.device_count()
    tokens = cfg.data.global_batch * cfg.data.seq_len
    meta = {"config": trainer.record}
    window = cfg.trainer.stop_after_nonfinite
    limit = min(window, total) if window else 0  # all of the run's steps when it is shorter
    in_a_row = 0
    if limit and start:
        try:
            in_a_row = trailing_skipped(read_metrics(run_dir), start)
        except MetricsError:
            in_a_row = 0
    skipped = int(jax.device_get(state["skipped"]))
    warned_window = -1  # the log_every window of the last non-finite warning

    t0 = time.perf_counter()
    finished, compiled = run_unless_signalled(lambda: trainer.program.compiled, pre)
    if not finished:  # signalled while compiling: nothing new to save, do not wait for XLA
        logger.message(
            f"preempted (signal {pre.received}) while compiling the train step, before step "
            f"{start + 1}: nothing new to save; exit {EXIT_PREEMPTED}"
        )
        return EXIT_PREEMPTED
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
        bad_batch = None
        if done < total:
            try:
                batch = trainer.batch(done)  # host work while the device runs the step
            except data_lib.DataError as e:  # raised after step `done` is saved, everywhere
                bad_batch = e
        m = jax.device_get(m)
        now = time.perf_counter()
        dt = now - t_prev
        if tracing and (done + 1 >= profile[1] or done == total):
            jax.profiler.stop_trace()
            tracing = False
        was_skipped = int(m["skipped_steps"]) > skipped
        in_a_row = in_a_row + 1 if was_skipped else 0
        skipped = int(m["skipped_steps"])
        window = (done - 1) // cfg.trainer.log_every
        if was_skipped and window != warned_window:  # at most once per log_every steps
            warned_window = window
            logger.message(
                f"warning: step {done} was skipped as non-finite (loss {float(m['loss']):.4g}, "
                f"grad norm {float(m['grad_norm']):.4g}): {skipped} of {done} steps skipped "
                f"so far (the run ends above trainer.max_skipped_fraction = "
                f"{cfg.trainer.max_skipped_fraction})"
            )
        too_many = too_many_skipped(
            skipped, done, total, cfg.trainer.log_every, cfg.trainer.max_skipped_fraction
        )
        record = {
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            "skipped_steps": skipped,
            "dropped_minibatches": int(m["dropped_minibatches"]),
            "target_tokens": float(m["target_tokens"]),
        }
        if peak:
            record["mfu"] = flops / dt / (peak * n_dev)
        failure = ckpt.background_failure()
        if failure is None:  # else the disk that failed the save would fail this write too
            try:
                logger.log_train(done, record)
            except MetricsError:
                ckpt.wait_until_finished()  # a failed background save (full disk) is the cause
                raise
        stop = pre.should_stop(
            done,
            save_failed=failure is not None,
            claim_lost=claim is not None and claim.lost is not None,
            nonfinite=(bool(limit) and in_a_row >= limit) or too_many,
            bad_data=bad_batch is not None,
        )
        _check_problems(pre, failure, claim)
        if "bad_data" in pre.problems:  # the next batch cannot be built: keep this step
            ckpt.save(done, state, metadata=meta, force=True)
            ckpt.wait_until_finished()
            raise bad_batch or data_lib.DataError(
                f"another process could not build the batch of step {done + 1} (its line "
                f"names the data problem); step {done} is saved at {ckpt.step_path(done)}"
            )
        if "nonfinite" in pre.problems:
            if bool(limit) and in_a_row >= limit:
                raise _nonfinite_error(cfg, done, in_a_row, ckpt)
            raise _skipped_fraction_error(cfg, done, skipped, ckpt)
        if cfg.trainer.eval_every and done % cfg.trainer.eval_every == 0:
            logger.log_eval(done, {"eval_loss": trainer.evaluate(state["params"])})
        if stop and pre.preempted:
            ckpt.save(done, state, metadata=meta, force=True)
            ckpt.wait_until_finished()
            logger.message(
                f"preempted (signal {pre.received}): saved {ckpt.step_path(done)}; exit "
                f"{EXIT_PREEMPTED}, run the same command again to resume"
            )
            return EXIT_PREEMPTED
        if done < total:
            ckpt.save(done, state, metadata=meta)
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
    if tracing:
        jax.profiler.stop_trace()
    ckpt.save(total, state, metadata=meta, force=True)
    ckpt.wait_until_finished()
    logger.message(f"done: step {total}, checkpoint {ckpt.step_path(total)}")
    return 0
