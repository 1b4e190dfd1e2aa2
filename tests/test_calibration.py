"""benchmarks/calibration.json: the step-time model against measured steps.

Every row within the target; the published Trainium rows name their source; the cheapest TPU
row's command, rerun here, prints the prediction the file holds (within 3 %). The whole table
is recomputed by benchmarks/calibrate.py (minutes to hours of CPU: the 70B row compiles a
Llama-2 70B layer on 128 emulated devices)."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = json.loads((ROOT / "benchmarks" / "calibration.json").read_text())
ROWS = TABLE["rows"]


def test_every_row_is_within_the_target_and_says_where_it_comes_from():
    assert TABLE["target_error_pct"] == 25
    for r in ROWS:
        assert (ROOT / r["config"]).is_file(), r["name"]
        assert r["role"] in ("fitted", "predicted"), r["name"]
        err = 100.0 * (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        assert r["error_pct"] == pytest.approx(err, abs=0.06), r["name"]
        assert abs(r["error_pct"]) <= 25.0, r["name"]
        assert r["measured_source"] and r["predict_command"], r["name"]
    trainium = [r for r in ROWS if r["platform"] in ("trn1", "trn2")]
    assert len(trainium) >= 2
    assert all(r["measured_source"].startswith("https://") for r in trainium)
    tpu = [r for r in ROWS if r["platform"] == "tpu-v5e"]
    assert len(tpu) >= 4 and {"fitted", "predicted"} <= {r["role"] for r in tpu}


@pytest.mark.slow
def test_the_cheapest_tpu_row_reproduces_its_prediction():
    """21-41 s: one dry-run of a 2-layer Fuji-width config on one emulated device."""
    tpu = [r for r in ROWS if r["platform"] == "tpu-v5e"]
    row = min(tpu, key=lambda r: r["features"]["dot_flops"])
    cmd = row["predict_command"].split()
    assert cmd[:2] == ["trn-accum", "dry-run"] and "--devices" in cmd
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *cmd[1:]],
        env=subprocess_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)["step_time"]["config"]["summary"]
    assert summary["predicted_step_s"] == pytest.approx(row["predicted_s"], rel=0.03)
