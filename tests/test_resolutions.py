"""The shipped configs are the settings search's output (benchmarks/resolutions.json, written by
benchmarks/resolve_configs.py): the 3B config states what its search picks, and every stored
search, replayed at today's step-time constants and rules, picks what it stored. A stored
candidate compiled afresh prices as stored, so the records describe today's programs."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from trn_accum.analysis import platforms, pricing, stepsummary, steptime
from trn_accum.analysis.recommend import Candidate
from trn_accum.config.auto import AUTO_KEYS, setting, with_settings
from trn_accum.config.load import config_to_dict, load_config
from trn_accum.plan import settings
from trn_accum.plan.perfmodel import Programs, predict
from trn_accum.plan.resolution import FIELDS, confirmed, values_of
from trn_accum.plan.settings import Target

ROOT = Path(__file__).resolve().parents[1]
RECORDS = json.loads((ROOT / "benchmarks" / "resolutions.json").read_text())["records"]


def rerun(name: str) -> str:
    return f"rerun python benchmarks/resolve_configs.py --only {name}"


def _config(rec: dict):
    return load_config(ROOT / rec["config"], rec["overrides"])


def repriced(summary: dict, plat: platforms.Platform) -> dict:
    """A stored candidate's summary with its ops priced from their features at `plat`'s
    constants now, combined with its collectives by the summary's own rule
    (`stepsummary.bounds`: ops + comm - overlap x min(ops, comm))."""
    features = {f: summary["ops"].get(f, 0.0) for f in pricing.FEATURES}
    ops = pricing.price(features, plat.peak_flops, plat.hbm_bytes_s, plat.efficiency)
    out = {**summary, "ops": ops, "overlap": plat.overlap}
    return stepsummary.bounds(
        out,
        summary["flops_per_step"],
        summary["peak_flops"],
        summary["tokens_per_step"],
        summary["flops_executed_per_step"],
    )


def replay(name: str, monkeypatch) -> dict:
    """The settings `settings.search` picks for `name`'s config and target with each candidate's
    compile read from the record (a candidate the record lacks fails, naming the rerun)."""
    rec = RECORDS[name]
    target = Target(**rec["target"])
    plat = platforms.get(target.platform)
    stored = {
        Candidate(**c["candidate"]).label(): c["summary"] for c in rec["resolution"]["candidates"]
    }

    def from_record(cfg, *, nodes, **_):
        values = {k: setting(cfg, k) for k in AUTO_KEYS}
        fields = {FIELDS[k]: v for k, v in values.items()}
        label = Candidate(mesh=settings.MESH, nodes=nodes, **fields).label()
        assert label in stored, f"{name}: {label} was not priced when recorded: {rerun(name)}"
        return repriced(stored[label], plat)

    monkeypatch.setattr(settings, "predict", from_record)
    cfg = _config(rec)
    s = settings.search(cfg, target)
    return confirmed(cfg, s.rows, target.nodes, plat.name, s.budget, None, 0.0).settings


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_record_read_the_config_as_it_is_now(name):
    rec = RECORDS[name]
    now = json.loads(json.dumps(config_to_dict(_config(rec)), default=str))
    changed = sorted(
        f"{section}.{key}"
        for section, values in now.items()
        for key, value in values.items()
        if rec["config_read"].get(section, {}).get(key) != value
    )
    assert not changed, f"{rec['config']} changed since its search was recorded: {rerun(name)}"


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_stored_search_replayed_today_picks_what_it_stored(name, monkeypatch):
    got = replay(name, monkeypatch)
    assert got == RECORDS[name]["resolution"]["settings"], rerun(name)


def test_the_3b_config_states_the_settings_its_search_picks(monkeypatch):
    written = load_config(ROOT / RECORDS["fuji-3b-trn2"]["config"])
    states = {k: setting(written, k) for k in AUTO_KEYS}
    assert replay("fuji-3b-trn2", monkeypatch) == states


def test_the_proxy_configs_leave_every_setting_to_the_search():
    for name in ("proxy-tpu-v5e-l4-auto", "proxy-tpu-v5e-l4-s8192-auto"):
        cfg = _config(RECORDS[name])
        assert {k: setting(cfg, k) for k in AUTO_KEYS if k != "trainer.reduce"} == {
            k: "auto" for k in AUTO_KEYS if k != "trainer.reduce"
        }


@pytest.mark.slow
def test_a_stored_candidate_compiled_afresh_prices_as_stored():
    """The cheapest stored compile of the seq 2048 proxy, compiled again on one CPU device:
    its predicted time and peak bytes are the record's (the features describe today's
    program; tolerance as tests/test_calibration.py's cheapest row)."""
    rec = RECORDS["proxy-tpu-v5e-l4-auto"]
    row = min(rec["resolution"]["candidates"], key=lambda c: c["summary"]["compile_s"])
    target = Target(**rec["target"])
    plat = platforms.get(target.platform)
    values = values_of(Candidate(**row["candidate"]))
    cfg = with_settings(_config(rec), values)
    layout = steptime.Layout.of(plat, devices_per_node=target.devices_per_node)
    got = predict(
        cfg,
        nodes=target.nodes,
        layout=layout,
        devices=jax.devices("cpu")[:1],
        plat=plat,
        programs=Programs(),
    )
    want = repriced(row["summary"], plat)
    assert got["predicted_step_s"] == pytest.approx(want["predicted_step_s"], rel=0.03)
    assert got["memory_bytes"] == pytest.approx(row["summary"]["memory_bytes"], rel=0.05)
