"""Issue 38, faults 2 and 4: a config file must name every section or extend another, and
every value's range is checked when the config loads (so `check-config` and `train` refuse the
same things with the same line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trn_accum.config.files import read_config_file
from trn_accum.config.load import MAX_SEED, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "fuji-tiny.toml"
BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some Windows editors write


def _refused(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_empty_config_file_is_refused_naming_every_section(tmp_path):
    p = tmp_path / "empty.toml"
    p.write_bytes(b"")
    msg = _refused(p)
    for name in ("[model]", "[mesh]", "[data]", "[optimizer]", "[trainer]", "[checkpoint]"):
        assert name in msg, msg
    assert "extends" in msg and str(p) in msg


def test_partial_config_file_lists_only_what_is_missing(tmp_path):
    p = tmp_path / "part.toml"
    p.write_text(TINY.read_text().split("[trainer]")[0])  # model, mesh, data, optimizer
    msg = _refused(p)
    assert "section(s) [trainer], [checkpoint]:" in msg, msg
    # an override names a key, not a section of the file: still refused
    assert "[trainer]" in _refused(p, ["trainer.steps=3"])


def test_extends_lays_the_file_over_its_base(tmp_path):
    (tmp_path / "sub").mkdir()
    base = tmp_path / "base.toml"
    base.write_text(TINY.read_text())
    mid = tmp_path / "sub" / "mid.toml"
    mid.write_text('extends = "../base.toml"\n[trainer]\nsteps = 7\n')
    top = tmp_path / "sub" / "top.toml"
    top.write_text('extends = "mid.toml"\n[trainer]\nlog_every = 3\n[data]\nseed = 5\n')
    cfg = load_config(top, ["checkpoint.keep=4"])
    want = load_config(
        TINY, ["trainer.steps=7", "trainer.log_every=3", "data.seed=5", "checkpoint.keep=4"]
    )
    assert cfg == want


@pytest.mark.parametrize(
    "text,needles",
    [
        ('extends = "nope.toml"\n', ["nope.toml", "does not exist", "relative"]),
        ("extends = 3\n", ["extends = 3", "config file path"]),
        ('extends = "self.toml"\n', ["cycle", "self.toml -> self.toml"]),
    ],
)
def test_bad_extends_is_one_line(tmp_path, text, needles):
    p = tmp_path / "self.toml"
    p.write_text(text)
    msg = _refused(p)
    assert all(n in msg for n in needles), msg


@pytest.mark.parametrize(
    "override,needles",
    [
        ("data.seed=-1", ["data.seed = -1", f"0..{MAX_SEED}"]),
        ("trainer.seed=-3", ["trainer.seed = -3", f"0..{MAX_SEED}"]),
        (f"data.seed={MAX_SEED + 1}", [f"data.seed = {MAX_SEED + 1}", "32-bit"]),
        ("trainer.max_skipped_fraction=1.5", ["trainer.max_skipped_fraction = 1.5", "[0, 1]"]),
        ("trainer.max_skipped_fraction=-0.1", ["trainer.max_skipped_fraction = -0.1", "[0, 1]"]),
    ],
)
def test_ranges_are_checked_when_the_config_loads(override, needles):
    msg = _refused(TINY, [override])
    assert all(n in msg for n in needles), msg


def test_seed_edges_load():
    cfg = load_config(TINY, ["data.seed=0", f"trainer.seed={MAX_SEED}"])
    assert (cfg.data.seed, cfg.trainer.seed) == (0, MAX_SEED)


@pytest.mark.parametrize("case", ["empty file", "negative seed"])
def test_check_config_and_train_refuse_with_the_same_line(tmp_path, capsys, case):
    from trn_accum import cli

    empty = tmp_path / "empty.toml"
    empty.write_text("")
    args = {
        "empty file": ["--config", str(empty)],
        "negative seed": ["--config", str(TINY), "--set", "data.seed=-1"],
    }[case]
    lines = []
    for argv in (["check-config", "--", *args], ["train", *args, "--run-dir", str(tmp_path)]):
        assert cli.main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1, out
        lines.append(out.err)
    assert lines[0] == lines[1] and "Traceback" not in lines[0]
    assert list(tmp_path.iterdir()) == [empty]  # train touched nothing


def test_max_skipped_fraction_is_free_to_change_on_resume():
    """A stop rule, like trainer.stop_after_nonfinite: it does not change the numbers."""
    from trn_accum.config import drift
    from trn_accum.config.load import Config, config_to_dict

    defaults = drift.run_record(config_to_dict(Config()), None)
    old = drift.run_record(config_to_dict(load_config(TINY)), None)
    new = load_config(TINY, ["trainer.max_skipped_fraction=0.9"])
    assert (
        drift.trajectory_changes(old, drift.run_record(config_to_dict(new), None), defaults) == {}
    )


# Issue 47: config files from other editors, and a key set in the wrong section


def test_config_file_with_a_byte_order_mark_loads_as_without(tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text(f'extends = "{TINY}"\n[trainer]\nsteps = 7\n')
    bom = tmp_path / "bom.toml"
    bom.write_bytes(BOM + plain.read_bytes())
    assert load_config(bom) == load_config(plain)
    assert load_config(plain).trainer.steps == 7


def test_not_utf8_after_a_byte_order_mark_names_the_byte_of_the_file(tmp_path):
    data = BOM + b'[trainer]\nx = "\xff"\n'
    p = tmp_path / "bad.toml"
    p.write_bytes(data)
    at = data.index(b"\xff")  # counted from the file's first byte, the mark's included
    with pytest.raises(ConfigError, match=rf"is not UTF-8 text \(byte {at}\)"):
        read_config_file(p)


@pytest.mark.parametrize("where", ["set", "file"])
def test_key_in_the_wrong_section_names_the_section_it_lives_in(tmp_path, where):
    if where == "set":
        msg = _refused(TINY, ["trainer.peak_lr=1e-3"])
    else:
        p = tmp_path / "wrong.toml"
        p.write_text(f'extends = "{TINY}"\n[trainer]\npeak_lr = 1e-3\n')
        msg = _refused(p)
    assert msg.startswith("unknown key trainer.peak_lr = 0.001: "), msg
    assert "peak_lr belongs to [optimizer], not [trainer]" in msg, msg
    assert "write optimizer.peak_lr" in msg, msg


def test_key_of_two_sections_names_both():
    msg = _refused(TINY, ["mesh.seed=3"])
    assert "seed belongs to [data] and [trainer], not [mesh]" in msg, msg
