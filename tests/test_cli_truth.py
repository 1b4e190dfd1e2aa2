"""The CLI says what it does: `check-config` refuses exactly what `train` refuses at start (the
same `step.check_start`), and every line the trainer prints fits the terminal (COLUMNS=80)."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env, user_error_line

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
FIGURES = ("loss", "gnorm", "lr", "tok/s", "s/step", "skipped", "dropped", "target_tokens")
ANSI = re.compile(r"\x1b\[[0-9]*[A-Za-z]")


class _Compiles(Exception):
    """Raised in place of the step's compile: the trainer accepted everything before it."""


def _check_config(k: int, capsys) -> tuple[int, str]:
    from trn_accum import cli

    code = cli.main(["check-config", "--", "--config", TINY, "--set", f"trainer.accum_steps={k}"])
    out = capsys.readouterr()
    return code, out.err.strip() if code else "ok"


def _train_start(k: int, run_dir: Path, capsys) -> tuple[int, str]:
    """`trn-accum train` in this process up to its compile (0, "ok") or its refusal."""
    from trn_accum import cli

    argv = ["train", "--config", TINY, "--set", f"trainer.accum_steps={k}"]
    try:
        code = cli.main([*argv, "--set", "trainer.steps=1", "--run-dir", str(run_dir)])
    except _Compiles:
        code = 0
    out = capsys.readouterr()
    return code, out.err.strip() if code else "ok"


def test_check_config_and_train_agree_on_every_accum_steps(tmp_path, capsys, monkeypatch):
    """K = 1..16 on fuji-tiny, 8 devices (mesh data 4 x fsdp 2): both accept K in {1, 2, 4}
    and refuse the rest with the same line. The compile is replaced by an exception here."""
    from trn_accum.train import step

    def compile_reached(*args, **kwargs):
        raise _Compiles

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(step, "build_step", compile_reached)
    accepted = []
    for k in range(1, 17):
        checked = _check_config(k, capsys)
        assert checked == _train_start(k, tmp_path / f"k{k}", capsys), k
        if checked[0] == 0:
            accepted.append(k)
        else:
            assert checked[0] == 2 and "accum_steps (" in checked[1], checked
            assert "valid accum_steps on this mesh: [1, 2, 4]" in checked[1], checked
    assert accepted == [1, 2, 4]


def test_check_config_devices_option(capsys):
    """--devices N checks the mesh for the job's devices; --only-config-args alone does not."""
    from trn_accum import cli

    args = ["--config", TINY, "--set", "trainer.accum_steps=4"]
    assert cli.main(["check-config", "--devices", "16", "--", *args]) == 2
    assert "on 16 devices) = 64: valid accum_steps on this mesh: [1, 2]" in capsys.readouterr().err
    assert cli.main(["check-config", "--devices", "3", "--", *args]) == 2
    assert "use 2 devices, which does not divide the 3 devices" in capsys.readouterr().err
    assert cli.main(["check-config", "--only-config-args", "--", *args]) == 0
    assert "not checked (pass --devices N)" in capsys.readouterr().out


def _run(*argv: str, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trn_accum.cli", *argv]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=subprocess_env(**env)
    )


def test_cli_refusal_is_the_same_line(tmp_path):
    """The real commands, in subprocesses: K=3 is refused by both with one identical line."""
    args = ["--config", TINY, "--set", "trainer.accum_steps=3"]
    checked = user_error_line(_run("check-config", "--", *args), 2, "accum_steps (3)")
    trained = user_error_line(_run("train", *args, "--run-dir", str(tmp_path)), 2)
    assert checked == trained


def test_train_lines_fit_80_columns(tmp_path):
    """check-config accepts K=2, and `trn-accum train` then trains under COLUMNS=80 with every
    line it prints at most 80 characters (a single word longer than that, a path, stands on a
    line of its own) and every figure still shown; metrics.jsonl keeps every figure of every
    step."""
    args = ["--config", TINY, "--set", "trainer.accum_steps=2"]
    checked = _run("check-config", "--", *args)
    assert checked.returncode == 0 and "ok on 8 devices" in checked.stdout, checked.stderr
    sets = ["--set", "trainer.steps=2", "--set", "trainer.log_every=1", "--set", "data.seq_len=32"]
    r = _run("train", *args, *sets, "--run-dir", str(tmp_path), COLUMNS="80")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    # a line over 80 may only be one word the wrap cannot split (the run dir's path in the
    # final "saved" message: pytest's tmp_path here is longer than 80 columns)
    assert not [ln for ln in lines if len(ln) > 80 and len(ln.split()) > 1], lines
    assert all(len(ln) <= 80 for ln in lines if ln.startswith(("step ", "  skipped"))), lines
    shown = "\n".join(lines)
    for figure in FIGURES:
        assert f"{figure} " in shown, (figure, shown)
    assert any(ln.startswith("step 2/2") for ln in lines), shown
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    keys = {"loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "skipped_steps"}
    assert [r["step"] for r in train] == [1, 2] and all(keys <= set(r) for r in train)


@pytest.mark.parametrize("columns", ["80", "200"])
def test_progress_bar_fits_and_redraws_in_place(tmp_path, monkeypatch, columns):
    """On a terminal the bar and its figures wrap at the width and each redraw moves the
    cursor back to the bar's first line (ANSI CPL), so the screen holds one bar."""
    from trn_accum.train.metrics import MetricsLogger

    monkeypatch.setenv("COLUMNS", columns)
    figures = {
        "loss": 2.5,
        "grad_norm": 0.5,
        "lr": 3e-4,
        "tokens_per_s": 1234567.0,
        "step_time_s": 12.5,
        "skipped_steps": 0,
        "dropped_minibatches": 0,
        "target_tokens": 16777216,
    }
    screen = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=3, console=screen, progress=True) as log:
        for s in (1, 2, 3):
            log.log_train(s, figures)
    text = screen.getvalue()
    drawn = [ANSI.sub("", ln) for ln in re.split(r"[\r\n]", text)]
    assert max(len(ln) for ln in drawn) <= int(columns)
    first = ANSI.sub("", text.split("\r")[1])  # the first drawing, all its lines
    assert all(f"{label} " in first for label in FIGURES), first
    if columns == "80":
        assert text.count("\x1b[1F") == 2  # two lines a bar: up one line for redraws 2 and 3
    else:
        assert "\x1b[1F" not in text  # one line a bar: \r alone redraws it
