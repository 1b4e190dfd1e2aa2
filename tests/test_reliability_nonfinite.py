"""Issue 38, fault 3: a run in which more than trainer.max_skipped_fraction of the steps were
skipped as non-finite ends non-zero in one line naming the suspects, whatever its length;
each skipped step is counted in the metrics and warned about at most once per log_every."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env, user_error_line

from trn_accum.errors import EXIT_USAGE
from trn_accum.train.metrics import read_metrics
from trn_accum.train.stop_rules import MIN_STEPS_JUDGED, too_many_skipped

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "skipped,done,total,every,fraction,stop",
    [
        (1, 1, 30, 1, 0.5, False),  # one step is too few to judge
        (6, 10, 30, 10, 0.5, True),  # 60 % at a log_every boundary
        (5, 10, 30, 10, 0.5, False),  # exactly half is not more than half
        (9, 9, 30, 10, 0.5, False),  # not a judged step
        (2, 3, 3, 10, 0.5, True),  # a short run is judged at its last step
        (30, 30, 30, 10, 1.0, False),  # 1 = never
        (1, 20, 30, 10, 0.0, True),  # 0 = any skipped step
    ],
)
def test_too_many_skipped(skipped, done, total, every, fraction, stop):
    assert too_many_skipped(skipped, done, total, every, fraction) is stop
    assert MIN_STEPS_JUDGED == 10


@pytest.mark.slow
def test_a_run_that_learns_nothing_ends_non_zero(tmp_path):
    """peak_lr 1e9 (the issue's case): the first update blows the parameters up, every later
    step is skipped. At step 10 (a log_every boundary) 9 of 10 were skipped: exit 2 in one
    line naming the suspects, no final checkpoint, one warning per 5 steps on the console."""
    run = tmp_path / "run"
    args = ["train", "--config", str(ROOT / "configs" / "fuji-tiny.toml"), "--run-dir", str(run)]
    for s in ("trainer.steps=30", "trainer.log_every=5", "optimizer.peak_lr=1e9"):
        args += ["--set", s]
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *args],
        env=subprocess_env(8),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    user_error_line(
        r,
        EXIT_USAGE,
        "step 10: 9 of the run's 10 steps (90%) were skipped as non-finite",
        "trainer.max_skipped_fraction = 0.5",
        "optimizer.peak_lr = 1000000000.0",
        "the data (synthetic)",
        "model.compute_dtype",
    )
    records = [x for x in read_metrics(run) if x["kind"] == "train"]
    assert [x["skipped_steps"] for x in records] == list(range(10))  # steps 1..10, counted
    warnings = [ln for ln in r.stdout.splitlines() if ln.startswith("warning: step")]
    assert len(warnings) == 2, r.stdout  # steps 2..5 and 6..10: once per log_every window
    assert warnings[0].startswith("warning: step 2 was skipped") and "1 of 2" in warnings[0]
    assert "done" not in r.stdout and not (run / "checkpoints" / "30").exists()
