"""What a new user meets first on the CPU fallback: the documented custom-data command trains as
written with no XLA_FLAGS (the CLI gives the config's mesh its emulated devices), a refused
start leaves no empty run dir, and `neuron-check` shows each row as it finishes."""

import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trn_accum import cli
from trn_accum.cli import emulated_cpu

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
FALLBACK_LINE = "CPU fallback: the mesh (data=-1, fsdp=2, model=1) runs on 8 emulated CPU devices"


def _user_env() -> dict:
    """The environment of a fresh shell: no XLA_FLAGS, no JAX_PLATFORMS (the suite sets both)."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    return env


def _docs_command(marker: str) -> list[str]:
    """The `trn-accum train` command of docs/configs.md that contains `marker` (a shell line
    continued with backslashes), as argv."""
    text = (ROOT / "docs" / "configs.md").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("trn-accum train")]
    found = [ln for ln in lines if marker in ln]
    assert len(found) == 1, found
    return shlex.split(found[0])


@pytest.fixture(scope="module")
def custom_data_run(tmp_path_factory):
    """docs/configs.md's custom-data command, run as written in a fresh shell's environment (a
    small prepared token dir for DIR, the run dir under tmp, 2 steps instead of 200)."""
    tmp = tmp_path_factory.mktemp("first-hour")
    text = tmp / "corpus.txt"
    text.write_text("\n".join(f"document {i}: " + "the quick brown fox " * 40 for i in range(30)))
    assert cli.main(["prepare-data", str(text), "--out", str(tmp / "tokens")]) == 0
    argv = _docs_command("data.kind=tokens")
    assert argv[:2] == ["trn-accum", "train"] and "data.path=DIR" in argv
    run_dir = tmp / "runs" / "mine"
    subs = {"data.path=DIR": f"data.path={tmp / 'tokens'}", "runs/mine": str(run_dir)}
    argv = [subs.get(a, a) for a in argv[2:]] + ["--set", "trainer.steps=2"]
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", "train", *argv],
        env=_user_env(), cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return r, run_dir


@pytest.mark.slow
def test_docs_custom_data_command_trains_on_cpu_without_flags(custom_data_run):
    r, run_dir = custom_data_run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    fallback = [line for line in r.stderr.splitlines() if FALLBACK_LINE in line]
    assert len(fallback) == 1 and "no Neuron or TPU here" in fallback[0], r.stderr[-2000:]
    assert "on 8 cpu devices, mesh {'data': 4, 'fsdp': 2, 'model': 1}" in r.stdout
    assert (run_dir / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_eval_hook_gives_the_runs_mesh_its_devices(custom_data_run):
    """`emulated_cpu.emulate_for_run_dir`, what `eval` calls before its backend starts: the
    run's recorded mesh gets its 8 devices in a fresh process."""
    r, run_dir = custom_data_run
    assert r.returncode == 0, r.stderr[-2000:]
    code = (
        "import sys, jax\n"
        "from trn_accum.cli.emulated_cpu import emulate_for_run_dir\n"
        "assert emulate_for_run_dir(sys.argv[1], []) is None\n"
        "print(jax.default_backend(), jax.device_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        env=_user_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cpu", "8"] and FALLBACK_LINE in out.stderr


def test_check_config_emulates_the_mesh_unless_the_user_set_a_count():
    args = ["check-config", "--", "--config", TINY]
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *args],
        env=_user_env(), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok on 8 devices") and FALLBACK_LINE in r.stderr
    env = dict(_user_env(), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok on 4 devices") and "CPU fallback" not in r.stderr


def test_refused_start_leaves_no_run_dir(tmp_path, capsys):
    """The batch split refused at start: the run dir (and the parents it made) are gone; a
    run dir that was there before stays."""
    bad = ["--config", TINY, "--set", "data.global_batch=30"]
    new = tmp_path / "new" / "runs" / "mine"
    assert cli.main(["train", *bad, "--run-dir", str(new)]) == 2
    assert "data.global_batch = 30" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    assert cli.main(["train", *bad, "--run-dir", str(old)]) == 2
    assert old.is_dir()


@pytest.mark.parametrize(
    "axes, batch, k, devices",
    [
        ({"data": -1, "fsdp": 2, "model": 1}, 32, 4, 8),  # fuji-tiny: 4 x 2
        ({"data": -1, "fsdp": 2, "model": 1}, 12, 3, 4),  # 8 and 6 do not split 12 by 3
        ({"data": -1, "fsdp": 2, "model": 1}, 32, "auto", 8),
        ({"data": 1, "fsdp": 4, "model": 4}, 32, 2, 16),  # fixed sizes: their product
        ({"data": -1, "fsdp": 1, "model": 1}, 30, 1, 6),
        ({"data": -1, "fsdp": -1, "model": 1}, 32, 1, None),  # two -1: the loader names it
    ],
)
def test_devices_for_mesh(axes, batch, k, devices):
    assert emulated_cpu.devices_for_mesh(axes, batch, k) == devices


@pytest.mark.parametrize(
    "env, cpu",
    [
        ({"JAX_PLATFORMS": "cpu"}, True),
        ({"JAX_PLATFORMS": "tpu"}, False),
        ({"JAX_PLATFORMS": "neuron,cpu"}, False),
        ({"JAX_PLATFORMS": "cpu", "TRN_ACCUM_PROCESS_ID": "0", "TRN_ACCUM_NUM_PROCESSES": "2",
          "TRN_ACCUM_COORDINATOR": "127.0.0.1:1234"}, False),  # a job sizes its own devices
        ({"JAX_PLATFORMS": "cpu", "TRN_ACCUM_PROCESS_ID": "0"}, True),  # one process
    ],
)  # fmt: skip
def test_cpu_fallback_only_off_accelerators_in_one_process(env, cpu):
    assert emulated_cpu.on_cpu_fallback(env) is cpu


def test_neuron_check_prints_each_row_as_it_finishes(tmp_path):
    """The real command's stderr: its first rows arrive while the later ones still compute
    (the process is read until its third row, then stopped: the model rows take minutes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trn_accum.cli", "neuron-check", "--run-dir", str(tmp_path)],
        env=_user_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    rows, deadline = [], time.monotonic() + 120
    try:
        while len(rows) < 3 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            row = re.match(r"\[ *\d+/\d+\] (?:pass|skip|FAIL)  (\S+) ", line)
            if row:
                rows.append(row.group(1))
        running = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert rows == ["root", "platform", "lnc"], rows
    assert running  # the last row (cache) is not computed yet


def test_plot_without_matplotlib_names_the_install_from_the_checkout(tmp_path, monkeypatch):
    """The hint names the extra of the checkout (`pip install -e '.[plot]'`): the package is
    not on PyPI, so `pip install 'trn_accum[plot]'` would find nothing."""
    from trn_accum.train.metrics import PlotError, plot_run

    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(PlotError) as e:
        plot_run(tmp_path)
    assert "pip install -e '.[plot]'" in str(e.value) and "\n" not in str(e.value)
