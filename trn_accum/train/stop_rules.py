"""Why a run stops at a step boundary, beside a signal: its non-finite steps (too many in a row,
or too large a share of the run), a failed checkpoint save, a lost run-dir claim; each as the
one-line error the trainer exits with. `NonfiniteWatch` counts the skipped steps."""

from __future__ import annotations

import dataclasses

from trn_accum.checkpoint import rundir
from trn_accum.checkpoint.checkpointer import CheckpointError
from trn_accum.config.load import Config
from trn_accum.config.mesh_rules import TrainError
from trn_accum.errors import EXIT_SAVE_FAILED
from trn_accum.train.metrics import MetricsError, read_metrics, trailing_skipped


def data_and_newest(cfg: Config, ckpt) -> tuple[str, str]:
    """(the data a non-finite error names, the newest committed checkpoint or "none yet")."""
    steps = ckpt.committed_steps()
    newest = ckpt.step_path(steps[-1]) if steps else "none yet"
    d = cfg.data
    if d.kind == "mixture":
        data = "mixture of " + ", ".join(str(c.get("path")) for c in d.mixture)
    else:
        data = "synthetic" if d.kind == "synthetic" else f"{d.kind} {d.path}"
    return data, newest


def nonfinite_error(cfg: Config, done: int, count: int, ckpt) -> TrainError:
    data, newest = data_and_newest(cfg, ckpt)
    return TrainError(
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


def skipped_fraction_error(cfg: Config, done: int, skipped: int, ckpt) -> TrainError:
    data, newest = data_and_newest(cfg, ckpt)
    return TrainError(
        f"step {done}: {skipped} of the run's {done} steps ({skipped / done:.0%}) were skipped "
        f"as non-finite (loss or gradient norm NaN/inf), more than "
        f"trainer.max_skipped_fraction = {cfg.trainer.max_skipped_fraction}: the run is not "
        f"learning; suspects: the learning rate (optimizer.peak_lr = {cfg.optimizer.peak_lr}), "
        f"the data ({data}), the precision without loss scaling (model.compute_dtype = "
        f"{cfg.model.compute_dtype}); newest checkpoint: {newest}"
    )


def check_problems(pre, failure, claim) -> None:
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


@dataclasses.dataclass
class NonfiniteWatch:
    """The run's steps skipped as non-finite: in a row, in all, and the `log_every` window of
    the last warning (at most one warning per window)."""

    limit: int  # stop after this many in a row (0: never)
    every: int  # trainer.log_every
    fraction: float  # trainer.max_skipped_fraction
    total: int  # trainer.steps
    skipped: int  # in all, so far
    in_a_row: int = 0
    warned_window: int = -1

    @classmethod
    def resume(cls, cfg: Config, run_dir: str, start: int, skipped: int) -> NonfiniteWatch:
        """The watch of a run resumed at `start` (0: a fresh run) with `skipped` steps skipped:
        the trailing run of skipped steps read back from metrics.jsonl."""
        window, total = cfg.trainer.stop_after_nonfinite, cfg.trainer.steps
        limit = min(window, total) if window else 0  # all of the run's steps when shorter
        in_a_row = 0
        if limit and start:
            try:
                in_a_row = trailing_skipped(read_metrics(run_dir), start)
            except MetricsError:
                in_a_row = 0
        t = cfg.trainer
        return cls(limit, t.log_every, t.max_skipped_fraction, total, skipped, in_a_row)

    def update(self, skipped: int, done: int) -> bool:
        """Count step `done` (`skipped`: the run's count after it); True when step `done` was
        skipped and is the first warned of its `log_every` window."""
        was_skipped = skipped > self.skipped
        self.in_a_row = self.in_a_row + 1 if was_skipped else 0
        self.skipped = skipped
        window = (done - 1) // self.every
        if was_skipped and window != self.warned_window:
            self.warned_window = window
            return True
        return False

    def too_many_in_a_row(self) -> bool:
        return bool(self.limit) and self.in_a_row >= self.limit

    def should_stop(self, done: int) -> bool:
        """Whether the run ends at step `done` for its non-finite steps."""
        return self.too_many_in_a_row() or too_many_skipped(
            self.skipped, done, self.total, self.every, self.fraction
        )

    def error(self, cfg: Config, done: int, ckpt) -> TrainError:
        """The error the run ends with once `should_stop(done)`."""
        if self.too_many_in_a_row():
            return nonfinite_error(cfg, done, self.in_a_row, ckpt)
        return skipped_fraction_error(cfg, done, self.skipped, ckpt)
