"""Issue 38, fault 4: `plot` on a run dir it cannot write into is one line naming the file and
the fix (`--out PATH`), and `--out` writes where it is told."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from tmpfs import small_tmpfs

from trn_accum import cli

pytest.importorskip("matplotlib")


def _write_metrics(run) -> None:
    records = [
        {"kind": "train", "step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0}
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def read_only_run(tmp_path):
    """A run dir with metrics that this process cannot write into: mode 0555, or (root writes
    through modes) a tmpfs remounted read-only."""
    run = tmp_path / "run"
    if os.geteuid() != 0:
        run.mkdir()
        _write_metrics(run)
        run.chmod(0o555)
        yield run
        run.chmod(0o755)
        return
    with small_tmpfs(run, 1_000_000):
        _write_metrics(run)
        subprocess.run(["mount", "-o", "remount,ro", str(run)], check=True)
        yield run


def test_plot_into_a_read_only_run_dir_is_one_line(read_only_run, capsys):
    assert cli.main(["plot", str(read_only_run)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(read_only_run / "metrics.png") in err and "--out" in err, err
    assert "Permission denied" in err or "Read-only file system" in err, err


def test_plot_out_writes_elsewhere(read_only_run, tmp_path, capsys):
    out = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(read_only_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.stat().st_size > 1000


def test_plot_to_a_missing_folder_is_one_line(read_only_run, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "m.png"
    assert cli.main(["plot", str(read_only_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(out) in err, err
