"""The one settings search (trn_accum/plan/settings.py): every "auto" of a config chosen by
predicted step time among the candidates that fit, the headroom rule stated once
(`recommend.HEADROOM_BAND`), a pick the platform's compiler refuses giving way, and the dry-run
and `trn-accum train` resolving through the same function to the same settings."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trn_accum.analysis.memory import GIB
from trn_accum.config.auto import AUTO_KEYS, auto_keys
from trn_accum.config.load import load_config
from trn_accum.plan import resolution, settings, settings_run
from trn_accum.plan.resolution import Refused, SettingsError
from trn_accum.plan.settings import Target

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
ALL_AUTO = [f"{k}=auto" for k in AUTO_KEYS]
TRN2_NODE = Target("trn2", 8, 1)


def fake_predict(time_of, bytes_of):
    """A `perfmodel.predict` stand-in: the candidate config's predicted time and memory from
    two functions of it (no compile), so that the search's staging and choice are checked
    exactly."""
    seen = []

    def predict(cfg, *, nodes, **kw):
        seen.append(cfg)
        t = time_of(cfg)
        return {
            "predicted_step_s": t,
            "step_s_no_overlap": t,
            "step_s_full_overlap": t,
            "memory_bytes": bytes_of(cfg),
            "compute_s": t,
            "comm_s": 0.0,
            "mfu": [0.5, 0.5],
            "tokens_per_s": [1.0, 1.0],
            "by_link": {},
            "mesh_shape": {},
            "target_mesh": {"data": 4, "fsdp": 2, "model": 1},
        }

    predict.seen = seen
    return predict


def _time(cfg):
    """Faster with flash, at block 64, with no remat, with the whole loss; k costs 10 % each."""
    m, t = cfg.model, cfg.trainer
    s = 1.0 + 0.1 * (t.accum_steps - 1)
    s *= 0.8 if m.attention == "flash" else 1.0
    s *= {"none": 1.0, "save_attention": 1.1, "save_qkvo": 1.2, "full": 1.4}[m.remat]
    s *= 1.0 if m.loss_chunk == 0 else 1.3
    s *= 0.99 if t.reduce == "once" else 1.0
    return s


def _bytes(cfg):
    """Memory falls with k and with remat; 1 GiB at k 4 with no remat."""
    saved = {"none": 1.0, "save_attention": 0.7, "save_qkvo": 0.6, "full": 0.3}[cfg.model.remat]
    return int(4 * GIB * saved / cfg.trainer.accum_steps)


def _cfg(budget_gib, sets=()):
    return load_config(TINY, [*ALL_AUTO, f"trainer.memory_budget_gib={budget_gib}", *sets])


def test_the_fastest_that_fits_wins_not_the_smallest_k_that_fits(monkeypatch):
    """Memory alone would take k 1 with remat full (1.2 GiB fits 1.5); the search prices and
    takes what runs fastest among the fits: no remat at k 4 (1 GiB), flash, the whole loss,
    reduce once."""
    predict = fake_predict(_time, _bytes)
    monkeypatch.setattr(settings, "predict", predict)
    res = settings.choose(_cfg(1.5), TRN2_NODE, devices=[])
    got = res.settings
    assert got["model.remat"] == "none" and got["trainer.accum_steps"] == 4, res.format()
    assert got["model.attention"] == "flash" and got["model.loss_chunk"] == 0
    assert got["trainer.reduce"] == "once"
    assert res.auto == list(AUTO_KEYS)
    fits = [r for r in res.rows if r["fits"]]
    fastest = min(fits, key=lambda r: r["summary"]["predicted_step_s"])
    assert res.pick["summary"] == fastest["summary"]
    assert res.line().startswith(
        "train will run: accum_steps 4, reduce once, remat none, attention flash 64, loss whole "
        "minibatch (chosen for trainer.accum_steps"
    ), res.line()


def test_headroom_takes_a_larger_k_within_the_band_and_no_further(monkeypatch):
    """With k costing 1 % a step, k 2 and k 4 sit within the 5 % band of k 1 (the fastest):
    the largest k of the band wins, at the same other settings; at 10 % a step k 1 stays."""
    cheap_k = lambda c: 1.0 + 0.01 * (c.trainer.accum_steps - 1)  # noqa: E731
    monkeypatch.setattr(settings, "predict", fake_predict(cheap_k, lambda c: GIB))
    res = settings.choose(_cfg(24, ["model.attention=blockwise"]), TRN2_NODE, devices=[])
    assert res.settings["trainer.accum_steps"] == 4, res.format()
    assert any("for memory headroom" in r for r in res.pick["reasons"])
    steep_k = lambda c: 1.0 + 0.1 * (c.trainer.accum_steps - 1)  # noqa: E731
    monkeypatch.setattr(settings, "predict", fake_predict(steep_k, lambda c: GIB))
    res = settings.choose(_cfg(24, ["model.attention=blockwise"]), TRN2_NODE, devices=[])
    assert res.settings["trainer.accum_steps"] == 1, res.format()


def test_each_stage_says_how_many_candidates_it_prices_and_about_how_long(monkeypatch):
    """Before each stage one line: its new candidates and, at the mean time of those priced so
    far, about how long they take (the first stage has no time to go by)."""
    monkeypatch.setattr(settings, "predict", fake_predict(_time, _bytes))
    heard = []
    settings.choose(_cfg(24, ["model.attention=auto"]), TRN2_NODE, devices=[], say=heard.append)
    stages = [line for line in heard if "to price" in line]
    assert stages[0] == "  k: 3 candidate(s) to price"
    assert stages[1].startswith("  one setting at a time: ") and ", about " in stages[1]
    priced = [line for line in heard if line.startswith("  [")]
    counts = [int(line.split(": ")[1].split()[0]) for line in stages]
    assert sum(counts) == len(priced)


def test_written_settings_are_kept_and_nothing_is_priced_without_auto(monkeypatch):
    predict = fake_predict(_time, _bytes)
    monkeypatch.setattr(settings, "predict", predict)
    cfg = load_config(TINY, ["trainer.accum_steps=auto", "trainer.memory_budget_gib=1.5"])
    res = settings.choose(cfg, TRN2_NODE, devices=[])
    assert res.auto == ["trainer.accum_steps"]
    assert {c.model.remat for c in predict.seen} == {"save_qkvo"}  # the config's
    assert {c.model.attention for c in predict.seen} == {"plain"}
    assert res.settings["model.remat"] == "save_qkvo"
    priced = len(predict.seen)
    res = settings.choose(load_config(TINY), TRN2_NODE, devices=[])
    assert len(predict.seen) == priced  # nothing "auto": nothing compiled or priced
    assert res.rows == [] and res.auto == [] and "as written" in res.line()


def test_a_pick_the_compiler_refuses_gives_way_to_the_next(monkeypatch):
    monkeypatch.setattr(settings, "predict", fake_predict(_time, _bytes))
    asked = []

    def confirm(cfg):
        t, m = cfg.trainer, cfg.model
        asked.append((t.accum_steps, t.reduce, m.remat, m.attention, m.loss_chunk))
        if len(asked) == 1:
            raise Refused("its compiler asked 1.70 GiB")

    res = settings.choose(_cfg(1.5), TRN2_NODE, devices=[], confirm=confirm)
    assert len(asked) == 2 and asked[0] != asked[1]
    assert res.refused and "its compiler asked 1.70 GiB" in res.refused[0]
    keys = ("trainer.accum_steps", "trainer.reduce", "model.remat", "model.attention")
    assert tuple(res.settings[k] for k in keys) + (res.settings["model.loss_chunk"],) == asked[1]
    assert not auto_keys(res.apply(_cfg(1.5)))


def test_nothing_fits_is_one_line_naming_the_budget(monkeypatch):
    monkeypatch.setattr(settings, "predict", fake_predict(_time, lambda c: 9 * GIB))
    with pytest.raises(SettingsError) as e:
        settings.choose(_cfg(1.0), TRN2_NODE, devices=[])
    msg = str(e.value)
    assert "\n" not in msg and "no candidate fits the budget of 1.00 GiB" in msg, msg
    assert "raise trainer.memory_budget_gib" in msg


def test_neuron_flash_is_a_candidate_on_neuron_after_its_row_passed(tmp_path, monkeypatch):
    from trn_accum.neuron import platform

    record = tmp_path / "neuron-check.json"
    monkeypatch.setattr(settings, "NEURON_CHECK_RECORD", str(record))
    monkeypatch.setattr(settings.neuron_flash_passed, "__defaults__", (str(record),))
    monkeypatch.setattr(platform, "neuron_available", lambda: True)
    assert settings.attention_kinds(TRN2_NODE) == ("blockwise", "flash")
    record.write_text(json.dumps({"rows": {"neuron-flash": "fail"}}))
    assert settings.attention_kinds(TRN2_NODE) == ("blockwise", "flash")
    settings.record_neuron_check({"neuron-flash": "pass", "lnc": "pass"}, str(record))
    assert settings.attention_kinds(TRN2_NODE) == ("blockwise", "flash", "neuron_flash")
    assert settings.attention_kinds(Target("tpu-v5e", 1, 1)) == ("blockwise", "flash")
    monkeypatch.setattr(platform, "neuron_available", lambda: False)
    assert settings.attention_kinds(TRN2_NODE) == ("blockwise", "flash")


def test_a_resolution_survives_json_and_picks_the_same_again():
    """The subprocess path sends a Resolution as JSON: read back, `confirmed` picks the same."""
    rows = [
        {
            "candidate": resolution.rec.Candidate("config", 1, k, "per_minibatch", "none"),
            "fits": k > 1,
            "summary": fake_predict(_time, _bytes)(
                load_config(TINY, [f"trainer.accum_steps={k}"]), nodes=1
            ),
        }
        for k in (1, 2, 4)
    ]
    cfg = load_config(TINY, ["trainer.accum_steps=auto", "model.remat=auto"])
    res = resolution.confirmed(cfg, rows, 1, "trn2", GIB, None, 0.0)
    back = resolution.Resolution.from_dict(json.loads(json.dumps(res.to_dict(), default=str)))
    again = resolution.confirmed(cfg, back.rows, 1, "trn2", GIB, None, 0.0)
    assert again.settings == res.settings and res.settings["trainer.accum_steps"] == 2


def test_a_subprocess_search_is_relayed_line_by_line_as_it_prices():
    """The subprocess's candidate lines reach `say` while it still runs (its stderr is read by a
    thread as it comes), not all at its end; other lines are kept for the error message."""
    import os
    import threading

    r, w = os.pipe()
    heard, kept = [], []
    got_first = threading.Event()

    def say(line):
        heard.append(line)
        got_first.set()

    reader, writer = os.fdopen(r), os.fdopen(w, "w")
    relay = threading.Thread(target=settings_run._relay, args=(reader, say, kept))
    relay.start()
    writer.write("  [1] config x1 k=2: 0.5 s\n")
    writer.flush()
    assert got_first.wait(10), "the first candidate line was not relayed before the end"
    writer.write("a warning\nsettings search for ...\n")
    writer.close()  # the end of the stream: the relay reads to it and returns
    relay.join(10)
    reader.close()
    assert heard == ["  [1] config x1 k=2: 0.5 s", "settings search for ..."]
    assert kept == ["  [1] config x1 k=2: 0.5 s", "a warning", "settings search for ..."]


@pytest.mark.slow
def test_dry_run_and_train_run_the_same_search_and_settings(tmp_path, monkeypatch):
    """`dry-run` and `trn-accum train` both resolve through `settings.choose` (counted), print
    and log the same "train will run" line, and train runs (and records) those settings."""
    from trn_accum.plan import dryrun
    from trn_accum.train import loop

    calls = []
    real = settings.search
    monkeypatch.setattr(settings, "search", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    over = ["model.attention=auto"]  # blockwise and flash: two compiles a search
    rep = dryrun.run(TINY, overrides=over, devices=8)
    chosen = rep["train_will_run"]
    assert chosen["auto"] == ["model.attention"]
    assert rep["attention"] == chosen["settings"]["model.attention"] in ("blockwise", "flash")
    assert chosen["line"] in dryrun.format_report(rep)

    monkeypatch.setattr(loop, "_loop", lambda trainer, *a: 0)
    console = io.StringIO()
    rc = loop.run(
        TINY,
        overrides=over,
        run_dir=str(tmp_path / "run"),
        console=console,
        settings=settings_run.for_run,
    )
    assert rc == 0, console.getvalue()
    assert chosen["line"].split(" (chosen")[0] in console.getvalue()
    assert calls == [TRN2_NODE, TRN2_NODE]  # one search each, for the same target
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["attention"] == chosen["settings"]["model.attention"]


def test_extrapolate_linear_in_depth():
    from trn_accum.analysis.memory import extrapolate

    assert extrapolate({2: 100, 4: 160}, 28) == 100 + 30 * 26
    assert extrapolate({4: 160, 2: 100}, 3) == 130
    with pytest.raises(ValueError):
        extrapolate({2: 1}, 28)


def test_auto_values_load_and_the_model_refuses_an_unresolved_auto():
    import jax

    from trn_accum.config.load import ConfigError
    from trn_accum.model import fuji

    cfg = load_config(TINY, ALL_AUTO)
    assert auto_keys(cfg) == list(AUTO_KEYS)
    with pytest.raises(ConfigError, match=r'model.loss_chunk = -1: must be >= 0 .* or "auto"'):
        load_config(TINY, ["model.loss_chunk=-1"])
    with pytest.raises(ConfigError, match="model.attention_block = 0: must be >= 1"):
        load_config(TINY, ["model.attention_block=0"])
    with pytest.raises(ConfigError, match="model.remat = 'some'"):
        load_config(TINY, ["model.remat=some"])
    params = jax.eval_shape(fuji.init_params, cfg.model, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((2, 8), "int32") for k in ("input_ids", "target_labels")}
    batch["target_mask"] = jax.ShapeDtypeStruct((2, 8), "bool")
    for key in ("model.remat", "model.attention"):
        one = load_config(TINY, [f"{key}=auto"])
        with pytest.raises(ValueError, match=f'{key} = "auto" is chosen before the step'):
            jax.eval_shape(lambda p, b, m=one.model: fuji.loss_fn(p, b, m), params, batch)


def test_a_trainer_without_the_search_refuses_auto_in_one_line():
    from trn_accum.config.mesh_rules import TrainError
    from trn_accum.train.trainer import Trainer

    with pytest.raises(TrainError) as e:
        Trainer.build(load_config(TINY, ["trainer.accum_steps=auto", "model.remat=auto"]))
    assert str(e.value).startswith('trainer.accum_steps, model.remat = "auto" is chosen by the')
    assert "\n" not in str(e.value)


def test_loss_chunk_report():
    from trn_accum.plan.dryrun_report import LOGIT_BYTES, loss_chunk_report

    cfg = load_config(TINY, ["model.loss_chunk=100", "data.seq_len=64"])
    rep = loss_chunk_report(cfg, 1, rows_per_minibatch=4)  # 256 tokens per shard
    assert rep == {
        "loss_chunk": 100,
        "tokens_per_chunk": 100,
        "chunks_per_minibatch": 3,
        "logit_bytes_per_device": 100 * 512 * LOGIT_BYTES,
    }
    cfg = load_config(TINY, ["model.loss_chunk=0"])
    assert loss_chunk_report(cfg, 1, 4)["tokens_per_chunk"] == 256


def test_check_config_prints_what_train_would_run(capsys):
    """`check-config --settings` runs the same search and prints the dry-run's line."""
    from trn_accum import cli as trn_cli

    argv = ["check-config", "--settings", "trn2", "--devices", "8", "--"]
    argv += ["--config", TINY, "--set", "model.attention=auto"]
    assert trn_cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("train will run: accum_steps 4, reduce per_minibatch, remat ")
    assert "(chosen for model.attention by the trn2 step-time model" in out[-1], out[-1]
