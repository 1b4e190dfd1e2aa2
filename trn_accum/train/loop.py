"""The training run: `run(config, run_dir)` trains or resumes, saves on preemption, logs.

    code = run("configs/fuji-tiny.toml", run_dir="runs/tiny")   # 0, or EXIT_PREEMPTED

What it trains is built by `trn_accum.train.trainer.Trainer`; why it stops early lives in
`trn_accum.train.stop_rules`; `_loop` below runs the steps, one named stage each.

The batch of step s depends only on (data seed, s): a resumed run sees the batches it would
have seen, so resuming from a checkpoint reproduces an uninterrupted run bit for bit.
SIGTERM/SIGINT set a flag (`trn_accum.train.preemption.Preemption`); all processes agree on a
step, save it, and exit `EXIT_PREEMPTED`.

The run dir is claimed for this job before anything in it is written, and the config is
checked against the one the resumed checkpoint was trained with (`trn_accum.checkpoint.rundir`,
`trn_accum.config.drift`).
At every step boundary the processes agree, in one all-gather, on whether to stop: a signal
(save, exit 75), a background checkpoint save that failed (exit 74, previous checkpoint
intact), a lost claim, or the last `trainer.stop_after_nonfinite` steps (all of them in a
shorter run) skipped as non-finite (exit 2), or more than `trainer.max_skipped_fraction` of
the run's steps skipped, judged every `log_every` steps and at the last (exit 2). A skipped
step is a warning on the console, at most one per `log_every` steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from trn_accum.checkpoint import rundir
from trn_accum.checkpoint.checkpointer import Checkpointer, make_writable_dir
from trn_accum.cluster import distributed
from trn_accum.config import drift
from trn_accum.config.load import Config, config_to_dict, load_config
from trn_accum.data import datasets as data_lib
from trn_accum.errors import EXIT_PREEMPTED, UserError
from trn_accum.model import fuji
from trn_accum.neuron import platform
from trn_accum.train import step
from trn_accum.train.flops import flops_per_step
from trn_accum.train.metrics import (
    MetricsError,
    MetricsLogger,
    console_width,
    fit_text,
    truncate_metrics,
)
from trn_accum.train.preemption import Preemption, exit_now_if_abandoned, run_unless_signalled
from trn_accum.train.stop_rules import NonfiniteWatch, check_problems
from trn_accum.train.trainer import Settings, Trainer

__all__ = ["Trainer", "run"]


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
    settings: Settings | None = None,
) -> int:
    """Train (or resume) the run in `run_dir`. Returns 0, or EXIT_PREEMPTED after a save.

    `run_dir` holds `checkpoints/` (orbax; the newest committed one is resumed automatically),
    `metrics.jsonl`, `config.json`, `owner.json` while a trainer runs
    (`trn_accum.checkpoint.rundir`), `config_changes.jsonl` once a change of a trajectory key
    was allowed
    (`allow_config_change`: keys or sections) and, with `profile=(start, stop)`, `profile/` (a
    jax.profiler trace of the steps numbered start..stop-1, numbered as logged: from 1).
    `settings` chooses the config's "auto" settings on the mesh (`Trainer.build`; `trn-accum
    train` hands in `trn_accum.plan.settings_run.for_run`).
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
        code = _run(
            cfg,
            pre,
            run_dir=run_dir,
            profile=profile,
            console=console,
            allowed=allowed,
            settings=settings,
        )
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


def _run(cfg: Config, pre, *, run_dir: str, profile, console, allowed, settings) -> int:
    _prepare_run_dir(run_dir)
    drift.check_same_config(config_to_dict(cfg))  # every rank runs process 0's config
    # config, mesh and data errors before the run dir is touched
    trainer = Trainer.build(cfg, settings=settings)
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
                if trainer.settings is not None:  # what the settings search chose, before compiling
                    logger.message(trainer.settings.format())
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
                return _loop(
                    trainer, state, _Run(ckpt, logger, run_dir, profile, pre, claim, start)
                )
    finally:
        if claim is not None:
            claim.release()


@dataclasses.dataclass
class _Run:
    """What the stages of one run's loop share: its checkpointer, logger, run dir, profile
    range (logged step numbers START, STOP), signal state, claim, and the step it starts at."""

    ckpt: Checkpointer
    logger: MetricsLogger
    run_dir: str
    profile: tuple[int, int] | None
    pre: Preemption
    claim: Any
    start: int


def _loop(trainer: Trainer, state, run: _Run) -> int:
    """Compile, then steps start+1..total: each run, logged, agreed on at its boundary, saved.
    Returns 0 or EXIT_PREEMPTED; raises the error a stop rule names."""
    compiled = _compile(trainer, run)
    if compiled is None:
        return EXIT_PREEMPTED
    batch = trainer.batch(run.start)
    if run.pre.should_stop(run.start):  # signalled before the first step: checkpoint current
        run.logger.message(
            f"preempted (signal {run.pre.received}) before step {run.start + 1}: nothing new to "
            f"save; exit {EXIT_PREEMPTED}"
        )
        return EXIT_PREEMPTED
    cfg, total = trainer.cfg, trainer.cfg.trainer.steps
    skipped = int(jax.device_get(state["skipped"]))
    watch = NonfiniteWatch.resume(cfg, run.run_dir, run.start, skipped)
    rate = _Rate.of(cfg)
    profiler = _Profiler(run.profile, os.path.join(run.run_dir, "profile"))
    t_prev = time.perf_counter()
    for s in range(run.start, total):
        profiler.before(s + 1)
        state, m = compiled(state, batch)
        done = s + 1
        batch, bad_batch = _next_batch(trainer, done)  # host work while the device runs
        m = jax.device_get(m)
        dt = time.perf_counter() - t_prev
        profiler.after(done, total)
        if watch.update(int(m["skipped_steps"]), done):
            _warn_skipped(run, cfg, done, m, watch.skipped)
        failure = run.ckpt.background_failure()  # once: it reports a failed save once
        if failure is None:  # else the disk that failed the save would fail this write too
            extra = data_lib.step_metrics(trainer.dataset, s)  # tokens per mixture part
            _log_step(run, done, {**rate.record(m, dt, watch.skipped), **extra})
        if _boundary(trainer, state, run, done, watch=watch, failure=failure, bad_batch=bad_batch):
            return EXIT_PREEMPTED
        t_prev = time.perf_counter()  # eval and checkpoint time is not step time
    profiler.stop()
    run.ckpt.save(total, state, metadata={"config": trainer.record}, force=True)
    run.ckpt.wait_until_finished()
    run.logger.message(f"done: step {total}, checkpoint {run.ckpt.step_path(total)}")
    return 0


def _compile(trainer: Trainer, run: _Run):
    """The compiled train step, or None when a signal came while compiling (nothing new to
    save, and no waiting for XLA)."""
    t0 = time.perf_counter()
    finished, compiled = run_unless_signalled(lambda: trainer.program.compiled, run.pre)
    if not finished:
        run.logger.message(
            f"preempted (signal {run.pre.received}) while compiling the train step, before step "
            f"{run.start + 1}: nothing new to save; exit {EXIT_PREEMPTED}"
        )
        return None
    run.logger.message(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    return compiled


def _next_batch(trainer: Trainer, done: int):
    """(the batch of step done + 1, None), or (None, the DataError building it raised: it is
    raised once step `done` is saved, on every process); (None, None) after the last step."""
    if done >= trainer.cfg.trainer.steps:
        return None, None
    try:
        return trainer.batch(done), None
    except data_lib.DataError as e:
        return None, e


@dataclasses.dataclass(frozen=True)
class _Rate:
    """What a step's time is divided into: tokens per step, FLOPs per step, the job's peak."""

    tokens: int
    flops: float
    peak: float | None  # per device; None where the platform's peak is unknown
    devices: int

    @classmethod
    def of(cls, cfg: Config) -> _Rate:
        tokens = cfg.data.global_batch * cfg.data.seq_len
        flops = flops_per_step(cfg)["total"]
        return cls(tokens, flops, platform.peak_flops_per_device(), jax.device_count())

    def record(self, m: dict, dt: float, skipped: int) -> dict:
        """The metrics.jsonl record of one step of `dt` seconds (metrics `m` on the host)."""
        record = {
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]),
            "tokens_per_s": self.tokens / dt,
            "step_time_s": dt,
            "skipped_steps": skipped,
            "dropped_minibatches": int(m["dropped_minibatches"]),
            "target_tokens": float(m["target_tokens"]),
        }
        if self.peak:
            record["mfu"] = self.flops / dt / (self.peak * self.devices)
        return record


class _Profiler:
    """A jax.profiler trace of the logged steps START..STOP-1 into `path` (None: no trace)."""

    def __init__(self, steps: tuple[int, int] | None, path: str):
        self.steps, self.path, self.tracing = steps, path, False

    def before(self, number: int) -> None:
        """Called before the step logged as `number` runs."""
        if self.steps and number == self.steps[0]:
            jax.profiler.start_trace(self.path)
            self.tracing = True

    def after(self, done: int, total: int) -> None:
        if self.tracing and (done + 1 >= self.steps[1] or done == total):
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


def _warn_skipped(run: _Run, cfg: Config, done: int, m: dict, skipped: int) -> None:
    run.logger.message(
        f"warning: step {done} was skipped as non-finite (loss {float(m['loss']):.4g}, "
        f"grad norm {float(m['grad_norm']):.4g}): {skipped} of {done} steps skipped so far "
        f"(the run ends above trainer.max_skipped_fraction = "
        f"{cfg.trainer.max_skipped_fraction})"
    )


def _log_step(run: _Run, done: int, record: dict) -> None:
    """Logs step `done` in metrics.jsonl and on the console."""
    try:
        run.logger.log_train(done, record)
    except MetricsError:
        run.ckpt.wait_until_finished()  # a failed background save (full disk) is the cause
        raise


def _boundary(trainer: Trainer, state, run: _Run, done: int, *, watch, failure, bad_batch) -> bool:
    """After step `done`: every process agrees whether to stop (one all-gather), then the run
    raises what a stop rule names, evaluates, and saves. `failure`: a background save's
    CheckpointError, `bad_batch`: the next batch's DataError. True: preempted and saved."""
    cfg, ckpt, pre = trainer.cfg, run.ckpt, run.pre
    meta = {"config": trainer.record}
    stop = pre.should_stop(
        done,
        save_failed=failure is not None,
        claim_lost=run.claim is not None and run.claim.lost is not None,
        nonfinite=watch.should_stop(done),
        bad_data=bad_batch is not None,
    )
    check_problems(pre, failure, run.claim)
    if "bad_data" in pre.problems:  # the next batch cannot be built: keep this step
        ckpt.save(done, state, metadata=meta, force=True)
        ckpt.wait_until_finished()
        raise bad_batch or data_lib.DataError(
            f"another process could not build the batch of step {done + 1} (its line "
            f"names the data problem); step {done} is saved at {ckpt.step_path(done)}"
        )
    if "nonfinite" in pre.problems:
        raise watch.error(cfg, done, ckpt)
    if cfg.trainer.eval_every and done % cfg.trainer.eval_every == 0:
        run.logger.log_eval(done, {"eval_loss": trainer.evaluate(state["params"])})
    if stop and pre.preempted:
        ckpt.save(done, state, metadata=meta, force=True)
        ckpt.wait_until_finished()
        run.logger.message(
            f"preempted (signal {pre.received}): saved {ckpt.step_path(done)}; exit "
            f"{EXIT_PREEMPTED}, run the same command again to resume"
        )
        return True
    if done < cfg.trainer.steps:
        ckpt.save(done, state, metadata=meta)
    return False
