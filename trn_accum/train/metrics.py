"""Training metrics: RUN_DIR/metrics.jsonl, the console, TensorBoard (optional), and plots.

One JSON object per line in `metrics.jsonl`: `{"step": int, "kind": "train" | "eval", ...scalars}`.
`step` is the number of optimizer steps completed when the record was made (the first train
record is step 1; its loss is that of the initial parameters on the batch of step index 0).
Lines are flushed as written, so a killed process leaves only complete lines (at most the last
one torn). Readers take the file as possibly torn or garbage (a torn write on a network
filesystem, foreign bytes): a line that is not UTF-8, not JSON or not a record is skipped. On
resume the file is cut back to the resumed step and rewritten with one record per (kind, step),
in step order, so the file always describes one trajectory. A metrics file that cannot be read
or written (a directory in its place, a full disk) is a one-line `MetricsError`.

Console: on a terminal, a progress bar rewritten in place; otherwise (Slurm / Kubernetes log
files) one plain line every `log_every` steps, plus the first and the last. Lines fit the
terminal's width (`shutil.get_terminal_size`: $COLUMNS, else the terminal; no limit in a log
file): the figures that do not fit go on indented continuation lines, none is dropped.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping
from typing import IO, Any

from trn_accum.errors import EXIT_SAVE_FAILED, UserError, one_line

METRICS_FILE = "metrics.jsonl"
KINDS = ("train", "eval")


class MetricsError(UserError):
    """The metrics file cannot be read or written: one line naming it and the cause."""


# Console order and format of the known train metrics; others are printed after them.
_CONSOLE = (
    ("loss", "loss", "{:.4f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("lr", "lr", "{:.3g}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("step_time_s", "s/step", "{:.3f}"),
    ("skipped_steps", "skipped", "{:d}"),
    ("dropped_minibatches", "dropped", "{:d}"),
    ("mfu", "mfu", "{:.2%}"),
)
_NOT_SHOWN = ("step", "kind", "time")  # record keys that are not figures
BAR_WIDTH = 24  # the progress bar's cells


def _jsonable(v: Any) -> Any:
    """A Python scalar for numpy / JAX scalars; non-finite floats as the strings "nan", "inf"."""
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no literal for them
    return v


def metrics_path(run_dir_or_file: str | os.PathLike) -> str:
    """RUN_DIR/metrics.jsonl for a run dir (a directory that is not itself named
    metrics.jsonl), else the path itself."""
    path = os.fspath(run_dir_or_file)
    if os.path.isdir(path) and os.path.basename(os.path.normpath(path)) != METRICS_FILE:
        path = os.path.join(path, METRICS_FILE)
    return path


def _check_file(path: str) -> None:
    if os.path.isdir(path):
        raise MetricsError(
            f"{path} is a directory, not the metrics file: move it aside (the run's metrics "
            f"start again from the resumed step)"
        )


def _parse_line(raw: bytes) -> dict | None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(rec, dict) and type(rec.get("step")) is int and rec["step"] >= 0
    return rec if ok and rec.get("kind", "train") in KINDS else None


def read_metrics(run_dir_or_file: str | os.PathLike) -> list[dict]:
    """All complete records, in file order; a torn, undecodable or invalid line is skipped.
    MetricsError when the file is a directory or cannot be read."""
    path = metrics_path(run_dir_or_file)
    _check_file(path)
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise MetricsError(f"cannot read {path} ({e.strerror}): fix its permissions") from None
    return [rec for line in lines if line.strip() and (rec := _parse_line(line)) is not None]


def truncate_metrics(run_dir: str | os.PathLike, keep_through_step: int) -> None:
    """Keeps the records with step <= `keep_through_step`, the last one of each (kind, step),
    in step order (train before eval), dropping torn lines; atomically (a rename)."""
    path = os.path.join(os.fspath(run_dir), METRICS_FILE)
    if not os.path.lexists(path):
        return
    last: dict[tuple[int, str], dict] = {}
    for r in read_metrics(path):
        if r["step"] <= keep_through_step:
            last[(r["step"], r.get("kind", "train"))] = r
    kept = [last[k] for k in sorted(last, key=lambda k: (k[0], KINDS.index(k[1])))]
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise MetricsError(
            f"cannot rewrite {path} ({e.strerror}): free space or fix the run dir's storage",
            exit_code=EXIT_SAVE_FAILED,
        ) from None


def trailing_skipped(records: Iterable[dict], through_step: int) -> int:
    """How many train steps up to `through_step` in a row, ending there, were skipped as
    non-finite (their cumulative `skipped_steps` rose by one); 0 where the record is missing."""
    skipped = {
        r["step"]: r["skipped_steps"]
        for r in records
        if r.get("kind", "train") == "train" and type(r.get("skipped_steps")) is int
    }
    skipped.setdefault(0, 0)
    n, s = 0, int(through_step)
    while s >= 1 and s in skipped and s - 1 in skipped and skipped[s] - skipped[s - 1] == 1:
        n, s = n + 1, s - 1
    return n


def _fmt(key: str, value: Any, spec: str) -> str:
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_parts(step: int, total: int, metrics: Mapping[str, Any]) -> list[str]:
    """["step 40/100", "loss 3.2100", "gnorm 0.812", "lr 0.0003", ...] (only the keys present,
    the known ones first, in `_CONSOLE` order)."""
    parts = [f"step {step}/{total}"]
    known = set()
    for key, label, spec in _CONSOLE:
        known.add(key)
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {_fmt(key, metrics[key], spec)}")
    for key, value in metrics.items():
        if key not in known and key not in _NOT_SHOWN:
            parts.append(f"{key} {_fmt(key, value, '{:.4g}')}")
    return parts


def format_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """`step 40/100  loss 3.2100  gnorm 0.812  lr 0.0003 ...` on one line."""
    return "  ".join(format_parts(step, total, metrics))


def console_width() -> int | None:
    """The columns to fit: $COLUMNS, else the terminal's (`shutil.get_terminal_size`); None
    (no limit) when neither is known, e.g. stdout is a log file."""
    columns = shutil.get_terminal_size(fallback=(0, 0)).columns
    return columns if columns > 0 else None


def fit_parts(parts: list[str], width: int | None, sep: str = "  ") -> list[str]:
    """`parts` joined by `sep` into lines of at most `width` characters (a part is never split;
    continuation lines are indented by `sep`); one line when `width` is None."""
    if width is None:
        return [sep.join(parts)]
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(sep + part)
    return lines


def fit_text(text: str, width: int | None) -> str:
    """`text` wrapped at spaces to lines of at most `width` characters (continuations indented
    by two; a longer word, e.g. a path, stays whole); unchanged when `width` is None."""
    if width is None:
        return text
    return "\n".join(
        textwrap.wrap(
            text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
        )
    )


class MetricsLogger:
    """Writes metrics to RUN_DIR/metrics.jsonl, the console and TensorBoard (when installed).

    Only the process with `enabled=True` (process 0) writes anything. `console`: a stream;
    progress-bar mode when it is a terminal (`progress=None` decides by `isatty()`).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        log_every: int = 10,
        enabled: bool = True,
        console: IO[str] | None = None,
        progress: bool | None = None,
        tensorboard: bool = True,
    ):
        self.run_dir = os.fspath(run_dir)
        self.total = total_steps
        self.log_every = max(1, int(log_every))
        self.enabled = enabled
        self.console = console if console is not None else sys.stdout
        if progress is None:
            isatty = getattr(self.console, "isatty", None)
            progress = bool(isatty and isatty())
        self.progress = progress
        self._file = None
        self._tb = None
        self._bar_lines = 0  # lines of the progress bar on screen, 0 when closed
        if not enabled:
            return
        path = os.path.join(self.run_dir, METRICS_FILE)
        _check_file(path)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise MetricsError(
                f"cannot open {path} ({e.strerror}): pass a writable --run-dir"
            ) from None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
            except ImportError:
                self._tb = None

    # -- writing ---------------------------------------------------------------------------

    def _record(self, step: int, kind: str, metrics: Mapping[str, Any]) -> dict:
        rec = {"step": int(step), "kind": kind, "time": round(time.time(), 3)}
        rec.update({k: _jsonable(v) for k, v in metrics.items()})
        if self._file is not None:
            try:
                self._file.write(json.dumps(rec) + "\n")
                self._file.flush()
            except OSError as e:
                path = os.path.join(self.run_dir, METRICS_FILE)
                raise MetricsError(
                    f"cannot write {path} ({e.strerror}): free space or fix the run dir's storage, "
                    f"then run the same command again to resume",
                    exit_code=EXIT_SAVE_FAILED,
                ) from None
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "kind", "time") and isinstance(v, int | float):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        return rec

    def log_train(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        rec = self._record(step, "train", metrics)
        parts = format_parts(step, self.total, rec)
        if self.progress:
            done = int(BAR_WIDTH * min(step, self.total) / max(self.total, 1))
            parts[0] = f"[{'#' * done + '.' * (BAR_WIDTH - done)}] {parts[0]}"
            lines = fit_parts(parts, console_width())
            # Back to the first line of the previous bar (ANSI "cursor previous line").
            up = f"\x1b[{self._bar_lines - 1}F" if self._bar_lines > 1 else ""
            self.console.write(up + "\r" + "\x1b[K\n".join(lines) + "\x1b[K")
            self.console.flush()
            self._bar_lines = len(lines)
            if step >= self.total:
                self._newline()
        elif step == 1 or step % self.log_every == 0 or step >= self.total:
            self.console.write("\n".join(fit_parts(parts, console_width())) + "\n")
            self.console.flush()

    def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        rec = self._record(step, "eval", metrics)
        self._newline()
        vals = [f"{k} {_fmt(k, v, '{:.4f}')}" for k, v in rec.items() if k not in _NOT_SHOWN] or [
            ""
        ]
        lines = fit_parts([f"eval at step {step}: {vals[0]}", *vals[1:]], console_width())
        self.console.write("\n".join(lines) + "\n")
        self.console.flush()

    def message(self, text: str) -> None:
        """A free-form line (resume, checkpoint, preemption notes), on the console only."""
        if not self.enabled:
            return
        self._newline()
        text = fit_text(text, console_width())
        self.console.write(text + "\n")
        self.console.flush()

    def _newline(self) -> None:
        if self._bar_lines:
            self.console.write("\n")
            self._bar_lines = 0

    def close(self) -> None:
        self._newline()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # a failed write was reported as a MetricsError
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- plotting --------------------------------------------------------------------------------


class PlotError(UserError):
    """User-facing plot error (missing matplotlib, no metrics)."""


def _series(records: Iterable[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    last: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if r.get("kind", "train") == kind and isinstance(v, int | float):
            last[r["step"]] = float(v)
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> str:
    """Loss (train, eval), learning rate and gradient norm vs step, to a PNG; returns its path."""
    path = os.path.join(os.fspath(run_dir), METRICS_FILE)
    if not os.path.lexists(path):
        raise PlotError(f"no {METRICS_FILE} in run dir {os.fspath(run_dir)!r}: train into it first")
    records = read_metrics(path)
    if not any(r.get("kind", "train") == "train" for r in records):
        raise PlotError(f"{path} has no train records yet: nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(
            f"plot needs matplotlib ({e}); install it from the trn_accum checkout with: "
            "pip install -e '.[plot]' (the package is not on PyPI)"
        ) from None
    out = os.fspath(out) if out else os.path.join(os.fspath(run_dir), "metrics.png")
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    s, v = _series(records, "train", "loss")
    axes[0].plot(s, v, label="train")
    s, v = _series(records, "eval", "eval_loss")
    if s:
        axes[0].plot(s, v, "o-", label="eval")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    for ax, key in ((axes[1], "lr"), (axes[2], "grad_norm")):
        s, v = _series(records, "train", key)
        ax.plot(s, v)
        ax.set_ylabel(key)
    axes[2].set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.abspath(os.fspath(run_dir))))
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as e:  # a read-only run dir, a missing folder, a bad suffix
        why = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
        raise PlotError(
            f"cannot write the plot to {out!r} ({why}): pass --out PATH.png in a writable folder"
        ) from None
    finally:
        plt.close(fig)
    return out
