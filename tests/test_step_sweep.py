"""The sweep cases and the proxy rows measured on the chip (benchmarks/step_sweep.py; no JAX run):
every row's figures follow from its config and its measured times by the project's own rules."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from trn_accum.analysis import platforms
from trn_accum.analysis.memory import footprint
from trn_accum.config.load import load_config
from trn_accum.train.flops import flops_per_step

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted((ROOT / "benchmarks" / "sweeps").glob("*.json"))
MEASURED = json.loads((ROOT / "benchmarks" / "measured-tpu-v5e.json").read_text())


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_case_is_a_valid_config_named_by_its_settings(path):
    cases = json.loads(path.read_text())
    assert len({c["name"] for c in cases}) == len(cases)
    for case in cases:
        cfg = load_config(ROOT / case["config"], case["set"])
        m, t = cfg.model, cfg.trainer
        want = f"s{cfg.data.seq_len}-k{t.accum_steps}-{m.remat}-{m.attention}"
        want += f"{m.attention_block}-lc{m.loss_chunk}"
        family = Path(case["config"]).stem.removeprefix("span-tpu-v5e-")
        if family != Path(case["config"]).stem:  # a span family: its config and batch named too
            want = f"{family}-{want}-b{cfg.data.global_batch}"
        assert case["name"] == want


def test_proxy_rows_mfu_and_footprint_follow_from_the_measurement():
    rows = MEASURED["proxy_rows"]
    assert len(rows) >= 10
    peak = platforms.get("tpu-v5e").peak_flops
    refused = [r for r in rows if "error" in r]
    assert all(r["refused_bytes"] > 15.75 * 2**30 for r in refused)  # the chip's refusals
    for row in [r for r in rows if "error" not in r]:
        cfg = load_config(ROOT / row["config"], row["set"])
        assert cfg.trainer.accum_steps == row["accum_steps"]
        assert row["median_step_s"] == pytest.approx(statistics.median(row["step_times_s"]), 1e-4)
        mfu = flops_per_step(cfg)["total"] / row["median_step_s"] / peak
        assert row["mfu"] == pytest.approx(mfu, abs=1e-4)
        assert row["footprint_bytes"] == footprint(row["memory"])
        assert row["device"] == "TPU v5 lite"
