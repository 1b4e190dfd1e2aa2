"""accum_steps = "auto" (trn_accum.autotune): candidates, the binary search with an injected
measure, depth extrapolation, and a real search on CPU with a small budget."""

import dataclasses
from pathlib import Path

import pytest

from trn_accum.analysis import autotune
from trn_accum.analysis.autotune import AutotuneError
from trn_accum.analysis.autotune import autotune as search
from trn_accum.config.load import load_config
from trn_accum.plan import autok, autosettings

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "fuji-tiny.toml")


class Recorder:
    """An injected measure: bytes from a table, calls recorded."""

    def __init__(self, table):
        self.table = dict(table)
        self.calls = []

    def __call__(self, k):
        self.calls.append(k)
        return self.table[k]


def test_candidate_steps():
    assert autotune.candidate_steps(64, 8) == (1, 2, 4, 8)
    assert autotune.candidate_steps(96, 8) == (1, 2, 3, 4, 6, 12)
    assert autotune.candidate_steps(64, 64) == (1,)
    with pytest.raises(AutotuneError, match="48 rows is not divisible by the 32 batch shards"):
        autotune.candidate_steps(48, 32)


@pytest.mark.parametrize("budget, expected", [(1000, 1), (999, 2), (300, 4), (101, 16), (100, 16)])
def test_binary_search_picks_smallest_that_fits(budget, expected):
    # Non-increasing in k (with a plateau), as compiled memory is.
    table = {1: 1000, 2: 600, 4: 300, 8: 200, 16: 100, 32: 100, 64: 90}
    m = Recorder(table)
    r = search(sorted(table), m, budget)
    assert r.accum_steps == expected
    assert table[expected] <= budget
    # The search measured the candidate just below the choice, which does not fit.
    cands = sorted(table)
    i = cands.index(expected)
    if i:
        assert table[cands[i - 1]] > budget and cands[i - 1] in r.table
    # Binary search: at most ceil(log2(7 + 1)) = 3 compiles, each k at most once.
    assert len(m.calls) <= 3 and len(set(m.calls)) == len(m.calls)
    assert r.table == {k: table[k] for k in sorted(m.calls)}


def test_every_candidate_fits_and_none_fits():
    m = Recorder({1: 10, 2: 9, 4: 8})
    r = search([4, 1, 2], m, 100)
    assert r.accum_steps == 1 and r.candidates == (1, 2, 4)
    assert m.calls == [2, 1]
    with pytest.raises(AutotuneError, match=r"even the largest candidate k=4 needs 8 B .* budget"):
        search([1, 2, 4], Recorder({1: 10, 2: 9, 4: 8}), 7)


def test_table_printout():
    table = {1: 3 << 30, 2: 2 << 30, 4: 1 << 30, 8: 1 << 29}
    r = search([1, 2, 4, 8], Recorder(table), 1.5 * 2**30)
    text = r.format()
    assert "budget 1.50 GiB per device" in text
    assert "chose accum_steps = 4" in text
    lines = {line.split()[0]: line for line in text.splitlines()[3:-1]}
    assert "2.00 GiB" in lines["2"] and lines["2"].endswith("no")
    assert "1.00 GiB" in lines["4"] and lines["4"].endswith("yes")
    assert "not compiled" in lines["1"]
    assert r.to_dict()["table"] == {"2": 2 << 30, "4": 1 << 30}


def test_extrapolate_linear_in_depth():
    assert autotune.extrapolate({2: 100, 4: 160}, 28) == 100 + 30 * 26
    assert autotune.extrapolate({4: 160, 2: 100}, 3) == 130
    with pytest.raises(ValueError):
        autotune.extrapolate({2: 1}, 28)


def test_compiled_memory_depth_modes(monkeypatch):
    """CompiledMemory with a fake compiler: extrapolation from two depths, and "auto" choosing
    full depth when the predicted compile is fast, reduced depths when it is slow."""
    cfg = load_config(TINY, ["model.num_layers=28"])
    compiled = []

    def fake(cfg, mesh, rows, seconds_per_layer):
        compiled.append((cfg.trainer.accum_steps, cfg.model.num_layers))
        layers = cfg.model.num_layers
        return 1000 + 10 * layers * 64 // cfg.trainer.accum_steps, 1.0 + seconds_per_layer * layers

    for per_layer, mode in ((0.1, "full"), (5.0, "extrapolate")):
        compiled.clear()
        monkeypatch.setattr(
            autok, "_compile_step_bytes", lambda c, m, r, f, s=per_layer: fake(c, m, r, s)
        )
        m = autok.CompiledMemory(cfg, mesh=None, batch_rows=64)
        exact = 1000 + 10 * 28 * 64 // 4
        assert m(4) == exact  # the fake is linear in depth: extrapolation is exact
        assert m.mode == mode
        m(8)
        if mode == "full":
            assert compiled == [(4, 2), (4, 4), (4, 28), (8, 28)]
            assert "full depth, 28 layers" in m.method
        else:
            assert compiled == [(4, 2), (4, 4), (8, 2), (8, 4)]
            assert "extrapolated linearly to 28" in m.method
        assert m.details[4]["bytes"] == exact


def test_resolve_keeps_integer_steps_and_uses_budget():
    cfg = load_config(TINY, ["trainer.accum_steps=2"])
    assert autok.resolve_accum_steps(cfg, mesh=None) == (cfg, None)

    class Mesh:  # only .shape is read when a measure is injected
        shape = {"data": 4, "fsdp": 2, "model": 1}

    cfg = load_config(
        TINY,
        ["trainer.accum_steps=auto", "data.global_batch=64", "trainer.memory_budget_gib=1.0"],
    )
    gib = 2**30
    m = Recorder({1: 3 * gib, 2: 2 * gib, 4: gib, 8: gib // 2})
    new, r = autok.resolve_accum_steps(cfg, Mesh(), measure=m)
    assert r.accum_steps == 4 and r.candidates == (1, 2, 4, 8)
    assert new.trainer.accum_steps == 4
    assert dataclasses.replace(new, trainer=cfg.trainer) == cfg


# ----------------------------------------------------------------------------- real compiles


@pytest.mark.slow
def test_auto_on_cpu_small_budget_search_dry_run_and_train(tmp_path, monkeypatch):
    """Tiny Fuji, 8 CPU devices, batch 64: candidates 1, 2, 4, 8. With a budget between the
    compiled footprints of k=2 and k=4, auto picks 4: its compiled memory fits, k/2 = 2's does
    not. Then the same through the dry-run (`dryrun.run` and the text `trn-accum dry-run` prints:
    the table and the choice; the dry-run's own compile of the chosen step fits the budget) and
    `loop.run` (auto resolved before the step is built, the table logged). Compiles are cached by
    configuration: the search, the dry-run and the trainer reuse the two measured here."""
    import io
    import json

    from trn_accum import cli
    from trn_accum.plan import dryrun
    from trn_accum.train import loop, step

    over = ["data.global_batch=64", "trainer.accum_steps=auto"]
    cfg = load_config(TINY, over)
    mesh = step.make_mesh(cfg)
    measure = autok.CompiledMemory(cfg, mesh)
    m2, m4 = measure(2), measure(4)
    assert m4 < m2, (m2, m4)  # activations dominate: memory falls with k
    budget_gib = (m2 + m4) / 2 / 2**30
    over += [f"trainer.memory_budget_gib={budget_gib}"]
    new, r = autok.resolve_accum_steps(load_config(TINY, over), mesh)
    assert r.accum_steps == 4 and new.trainer.accum_steps == 4
    assert r.table[4] == m4 <= r.budget_bytes < m2 == r.table[2]
    assert r.candidates == (1, 2, 4, 8)
    assert "full depth, 2 layers" in r.method

    # dry-run (in this 8-device process): the same search on the same figure, which is its fit
    # check's (the target's estimate: peak live bytes of the partitioned module, not XLA:CPU's)
    sets = [a for o in over for a in ("--set", o)]
    rep = dryrun.run(TINY, overrides=over, devices=8)
    assert rep["accum_steps"] == 4 and rep["autotune"]["table"] == {"2": m2, "4": m4}
    assert rep["fit"]["compiled_total_bytes"] == m4 <= rep["autotune"]["budget_bytes"] < m2
    assert "target's estimate" in rep["autotune"]["method"]
    text = dryrun.format_report(rep)
    assert 'accum_steps = "auto"' in text and "chose accum_steps = 4" in text
    assert json.loads(dryrun.format_report(rep, as_json=True))["autotune"]["accum_steps"] == 4
    assert cli.build_parser().parse_args(["dry-run", "--config", TINY, *sets]).overrides == over

    # train: auto resolved before the step is built and the table logged (the loop itself is
    # tests/test_train.py's business: skipped here)
    monkeypatch.setattr(loop, "_loop", lambda trainer, *a: trainer.cfg.trainer.accum_steps)
    console = io.StringIO()
    rc = loop.run(
        TINY,
        overrides=over,
        run_dir=str(tmp_path / "run"),
        console=console,
        settings=autosettings.resolve_for_run,
    )
    log = console.getvalue()
    assert rc == 4, log
    assert "chose accum_steps = 4" in log and "in 4 minibatches" in log
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["trainer"]["accum_steps"] == 4


def test_no_candidate_fits_is_one_line_user_error(monkeypatch):
    from trn_accum.plan import dryrun
    from trn_accum.train import loop

    monkeypatch.setattr(autok, "_compile_step_bytes", lambda cfg, mesh, rows, figure: (10**9, 0.1))
    over = ["trainer.accum_steps=auto", "trainer.memory_budget_gib=0.5"]
    with pytest.raises(AutotuneError, match="even the largest candidate k=4 needs 0.93 GiB"):
        loop.Trainer.build(load_config(TINY, over), settings=autosettings.resolve_for_run)
    with pytest.raises(AutotuneError, match="raise trainer.memory_budget_gib"):
        dryrun.run(TINY, overrides=over, devices=8)
