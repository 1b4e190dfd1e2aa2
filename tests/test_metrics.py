"""metrics.jsonl read as possibly torn or garbage: undecodable bytes and torn lines skipped, a
directory in its place a one-line error, resume cuts it back to one ordered record per (kind,
step), a failed write is a one-line error (EXIT_SAVE_FAILED), trailing non-finite steps."""

import io
import json
import os

import pytest

from trn_accum.errors import EXIT_SAVE_FAILED
from trn_accum.train.metrics import (
    MetricsError,
    MetricsLogger,
    PlotError,
    plot_run,
    read_metrics,
    trailing_skipped,
    truncate_metrics,
)


def _rec(step, kind="train", **kw):
    return json.dumps({"step": step, "kind": kind, "loss": 1.0 / step, **kw}).encode() + b"\n"


def test_garbage_bytes_are_skipped_by_readers_resume_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        _rec(1)
        + b"\xff\xfe\x00\x80 not utf-8 at all\n"  # a torn write on a network filesystem
        + _rec(2)
        + b'{"step": 3, "kind": "tr\xc3'  # torn mid-character, no newline ...
        + _rec(3)  # ... so the next record fused with it: both unreadable
        + _rec(4)
        + _rec(4, "eval", eval_loss=0.5)
        + b'{"step": "5", "kind": "train"}\n{"step": true}\n{"step": 6, "kind": "other"}\n[1]\n'
        + _rec(2)  # a duplicate (an older trainer's late write)
        + _rec(5)
    )
    assert [(r["step"], r["kind"]) for r in read_metrics(tmp_path)] == [
        (1, "train"), (2, "train"), (4, "train"), (4, "eval"), (2, "train"), (5, "train"),
    ]  # fmt: skip
    truncate_metrics(tmp_path, 4)
    lines = path.read_bytes().splitlines()
    assert [(json.loads(x)["step"], json.loads(x)["kind"]) for x in lines] == [
        (1, "train"), (2, "train"), (4, "train"), (4, "eval"),
    ]  # fmt: skip
    pytest.importorskip("matplotlib")
    path.write_bytes(path.read_bytes() + b"\x00\xff garbage again\n")
    out = plot_run(tmp_path, tmp_path / "m.png")
    assert os.path.getsize(out) > 1000


def test_metrics_file_that_is_a_directory_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    for call in (
        lambda: read_metrics(tmp_path),
        lambda: truncate_metrics(tmp_path, 3),
        lambda: MetricsLogger(tmp_path, total_steps=3, console=io.StringIO()),
        lambda: plot_run(tmp_path),
    ):
        with pytest.raises((MetricsError, PlotError)) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "is a directory" in msg and "metrics.jsonl" in msg


def test_failed_metrics_write_is_one_line_exit_74(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC
    log = MetricsLogger(tmp_path, total_steps=3, console=io.StringIO())
    with pytest.raises(MetricsError) as e:
        log.log_train(1, {"loss": 1.0})
    assert e.value.exit_code == EXIT_SAVE_FAILED
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    log.close()  # no second error on close


def test_trailing_skipped_counts_the_steps_in_a_row():
    def recs(skipped):  # cumulative skipped_steps after steps 1, 2, ...
        return [{"step": i + 1, "kind": "train", "skipped_steps": s} for i, s in enumerate(skipped)]

    assert trailing_skipped(recs([0, 0, 1, 2, 3]), 5) == 3
    assert trailing_skipped(recs([1, 2, 3]), 3) == 3  # every step of the run
    assert trailing_skipped(recs([1, 2, 3, 3]), 4) == 0
    assert trailing_skipped(recs([0, 1, 2, 3]), 3) == 2  # counted up to the resumed step
    gap = [r for r in recs([1, 2, 3, 4]) if r["step"] != 2]
    assert trailing_skipped(gap, 4) == 1  # a missing record ends the count
    assert trailing_skipped([], 7) == 0
