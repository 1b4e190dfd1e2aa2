"""The `trn-accum` CLI in subprocesses: exact resume after SIGTERM, a SIGKILL during a save,
an external SIGTERM, prepare-data + token training, plot, and a battery of bad inputs (one line
on stderr, exit 2, no traceback, nothing in the run dir lost)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import NO_JAX_CACHE, subprocess_env, user_error_line

from trn_accum.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
EXIT_PREEMPTED = 75


def cli(*args, env=None, timeout=300, fault=None, **kw):
    """`trn-accum ARGS` in a subprocess; `fault`: KIND=STEP injected by tests/fault_driver.py."""
    cmd = [sys.executable, "-m", "trn_accum.cli"]
    if fault:
        cmd = [sys.executable, str(ROOT / "tests" / "fault_driver.py"), fault, "--"]
    return subprocess.run(
        [*cmd, *map(str, args)],
        env=env or subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def train(run_dir, *sets, fault=None):
    args = ["train", "--config", TINY, "--run-dir", run_dir]
    for s in sets:
        args += ["--set", s]
    return cli(*args, fault=fault)


def _train_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def _final_params(run_dir, at_step):
    """The params of checkpoint `at_step`, as numpy, restored in this (8-device) process."""
    from trn_accum.checkpoint.checkpointer import Checkpointer
    from trn_accum.config.load import load_config
    from trn_accum.train import step

    cfg = load_config(TINY)
    program = step.build_step(cfg, step.make_mesh(cfg))
    target, _ = program.abstract_inputs()
    with Checkpointer(os.path.join(run_dir, "checkpoints")) as ck:
        state, _ = ck.restore(target, at_step)
    import jax

    return jax.device_get(state)


def _snapshot(path):
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(path))] = "dir"
    return out


# ---------------------------------------------------------------------------------------------
# Preemption and resume


@pytest.mark.slow
def test_resume_is_exact_after_sigterm_and_sigkill_during_save(tmp_path):
    """A: 20 steps straight. B: checkpoints every 3 steps; killed (SIGKILL) during the save of
    step 6; restarted: resumes from 3 (the previous checkpoint), SIGTERM after step 10: saves 10,
    exits 75; restarted: resumes from 10 and ends at 20. Steps 4-20 of B equal A's (loss,
    gradient norm, learning rate, bit for bit), and so do the final parameters."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = [
        "trainer.steps=20",
        "trainer.eval_every=10",
        "checkpoint.every=3",
        "checkpoint.keep=5",
    ]
    r = train(a, *common)
    assert r.returncode == 0, r.stderr[-3000:]

    r = train(b, *common, fault="sigkill_after_save_start=6")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    ckdir = Path(b) / "checkpoints"
    names = sorted(p.name for p in ckdir.iterdir())
    assert "3" in names and "6" not in names, names  # 6 was being written: not committed
    assert any(n.startswith("6.orbax-checkpoint-tmp") for n in names), names

    r = train(b, *common, fault="sigterm_after_step=10")
    assert r.returncode == EXIT_PREEMPTED, (r.returncode, r.stderr[-3000:])
    assert "resumed from" in r.stdout and "(step 3)" in r.stdout, r.stdout
    assert "6.orbax-checkpoint-tmp" in r.stderr and "freed" in r.stderr, r.stderr  # removed
    assert not any(".orbax-checkpoint-tmp" in p.name for p in ckdir.iterdir())
    assert "preempted" in r.stdout
    assert "10" in [p.name for p in ckdir.iterdir()]

    r = train(b, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(step 10)" in r.stdout

    ra, rb = _train_records(a), _train_records(b)
    assert sorted(rb) == list(range(1, 21)) == sorted(ra)
    for s in range(4, 21):
        for key in ("loss", "grad_norm", "lr", "skipped_steps", "target_tokens"):
            assert ra[s][key] == rb[s][key], (s, key, ra[s][key], rb[s][key])
    ea = [r for r in read_metrics(a) if r["kind"] == "eval"]
    eb = [r for r in read_metrics(b) if r["kind"] == "eval"]
    assert [e["eval_loss"] for e in ea] == [e["eval_loss"] for e in eb]

    pa, pb = _final_params(a, 20), _final_params(b, 20)
    import jax

    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(x, y)


def _start(args, **env) -> subprocess.Popen:
    """`trn-accum ARGS` started in the background, its output piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "trn_accum.cli", *map(str, args)],
        env=subprocess_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_external_sigterm_saves_and_exits_75(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run-dir", run, "--set", "trainer.steps=100000"]
    proc = _start(args)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    last = max(r["step"] for r in read_metrics(run))
    assert f"saved {run / 'checkpoints' / str(last)}" in out, out
    assert (run / "checkpoints" / str(last)).is_dir()


@pytest.mark.slow
def test_sigterm_during_the_first_compile_exits_75_at_once(tmp_path):
    """The signal arrives right after the "training ..." line, i.e. while the step compiles: the
    trainer exits 75 without waiting for XLA (a trn2 compile of the 3B step outlasts a grace
    period), writes no checkpoint and releases its claim (the next start finds the run dir
    free)."""
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run-dir", run, "--set", "trainer.steps=2"]
    proc = _start(args, **NO_JAX_CACHE)  # a real compile, not a cache hit
    try:
        for line in proc.stdout:
            if line.startswith("training "):
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, (out, err[-3000:])
    assert "while compiling the train step, before step 1: nothing new to save" in out, out
    assert "compiled the train step" not in out and "Traceback" not in err, (out, err)
    assert not (run / "owner.json").exists() and not list((run / "checkpoints").iterdir())


@pytest.mark.xdist_group("trn_cli_done_run")
@pytest.mark.slow
def test_two_processes_train_then_resume_on_one(done_run, tmp_path):
    """2 processes x 4 devices (jax.distributed via trn_accum.distributed) follow the
    single-process trajectory; their checkpoint resumes on 1 process x 8 devices."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run-dir", run, "--set", "trainer.steps=4"]
    args += ["--set", "checkpoint.every=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trn_accum.cli", *map(str, args)],
            env=subprocess_env(
                devices=4,
                TRN_ACCUM_PROCESS_ID=str(i),
                TRN_ACCUM_NUM_PROCESSES="2",
                TRN_ACCUM_COORDINATOR=f"127.0.0.1:{port}",
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    one, two = _train_records(done_run / "run"), _train_records(run)
    assert sorted(two) == [1, 2, 3, 4]
    for s in range(1, 5):
        for key in ("loss", "grad_norm", "lr"):
            assert two[s][key] == pytest.approx(one[s][key], rel=1e-5), (s, key)
    r = train(run, "trainer.steps=6", "checkpoint.every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(step 4)" in r.stdout and sorted(_train_records(run)) == list(range(1, 7))


# ---------------------------------------------------------------------------------------------
# Other commands


def test_prepare_data_train_on_tokens_and_plot(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 40 + "\n") * 10)
    out = tmp_path / "tok"
    r = cli("prepare-data", text, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "tokens" in r.stdout and (out / "meta.json").exists()
    run = tmp_path / "run"
    r = cli(
        "train", "--config", TINY, "--run-dir", run, "--profile", "1:2",
        "--set", "data.kind=tokens", "--set", f"data.path={out}",
        "--set", "trainer.steps=3", "--set", "trainer.eval_every=3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(_train_records(run)) == [1, 2, 3]
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "eval"] == [3]
    assert any(p.is_file() for p in (run / "profile").rglob("*.xplane.pb"))
    r = cli("plot", run, "-o", tmp_path / "m.png")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------
# Bad inputs


@pytest.fixture(scope="session")
def done_run(tmp_path_factory):
    """The tiny config run for 24 steps (eval and checkpoints every 12), and token data."""
    base = tmp_path_factory.mktemp("done")
    run = base / "run"
    r = train(run, "trainer.steps=24", "trainer.eval_every=12", "checkpoint.every=12")
    assert r.returncode == 0, r.stderr[-3000:]
    text = base / "t.txt"
    text.write_text("hello world, " * 200)
    r = cli("prepare-data", text, "--out", base / "tok")
    assert r.returncode == 0, r.stderr
    return base


@pytest.mark.xdist_group("trn_cli_done_run")
def test_tiny_run_trains_evaluates_checkpoints(done_run):
    run = done_run / "run"
    recs = read_metrics(run)
    tr = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in tr] == list(range(1, 25))
    assert [r["step"] for r in ev] == [12, 24]
    assert tr[-1]["loss"] < 0.7 * tr[0]["loss"], (tr[0]["loss"], tr[-1]["loss"])
    assert ev[1]["eval_loss"] < ev[0]["eval_loss"]
    # 1-based warmup over 10 steps to 3e-3: step 1 gets 1/10 of the peak, step 10 the peak.
    assert tr[0]["lr"] == pytest.approx(3e-4, rel=1e-3) and tr[0]["lr"] > 0
    assert tr[9]["lr"] == pytest.approx(3e-3, rel=1e-3)
    for key in ("grad_norm", "tokens_per_s", "step_time_s", "skipped_steps", "target_tokens"):
        assert key in tr[-1]
    assert all(r["dropped_minibatches"] == 0 for r in tr)  # logged every step; none dropped
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "24"]
    assert json.loads((run / "config.json").read_text())["trainer"]["steps"] == 24
    # Lines are complete JSON objects.
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    # Starting again at the end: nothing to do, nothing changed.
    before = _snapshot(run)
    r = train(run, "trainer.steps=24")
    assert r.returncode == 0 and "already at step 24" in r.stdout, r.stderr[-2000:]
    assert _snapshot(run) == before


def _bad_cases(base):
    run = base / "run"
    tok = base / "tok"
    trunc = base / "trunc"
    if not trunc.exists():
        shutil.copytree(tok, trunc)
        with open(trunc / "tokens.bin", "r+b") as f:
            f.truncate(os.path.getsize(trunc / "tokens.bin") - 7)
    bad_toml = base / "bad.toml"
    bad_toml.write_text("[model\nvocab_size = 3\n")
    a_file = base / "a_file"
    a_file.write_text("x")
    t = ["train", "--config", TINY, "--run-dir", run]
    return {
        "unknown config key": (t + ["--set", "model.vocab=3"], "model.vocab"),
        "bad --set syntax": (t + ["--set", "trainer.steps"], "section.key=value"),
        "wrong type": (t + ["--set", "trainer.steps=many"], "trainer.steps"),
        "heads do not divide": (t + ["--set", "model.num_heads=5"], "model.num_heads"),
        "batch vs steps x shards": (t + ["--set", "trainer.accum_steps=8"], "accum_steps (8)"),
        "mesh larger than devices": (
            t + ["--set", "mesh.data=1", "--set", "mesh.fsdp=16", "--set", "trainer.accum_steps=1"],
            "16 devices",
        ),
        "missing token file": (
            t + ["--set", "data.kind=tokens", "--set", f"data.path={base / 'nope'}"],
            "does not exist",
        ),
        "truncated token file": (
            t + ["--set", "data.kind=tokens", "--set", f"data.path={trunc}"],
            "truncated",
        ),
        "data vocab > model vocab": (
            t
            + [
                "--set",
                "data.kind=tokens",
                "--set",
                f"data.path={tok}",
                "--set",
                "model.vocab_size=200",
            ],  # fmt: skip
            "vocab_size",
        ),
        "unwritable run dir": (
            ["train", "--config", TINY, "--run-dir", a_file / "sub"],
            "not writable",
        ),
        "missing config file": (["train", "--config", base / "none.toml"], "does not exist"),
        "invalid TOML": (["train", "--config", bad_toml], "not valid TOML"),
        "bad --profile": (t + ["--profile", "5:2"], "--profile"),
        "unknown command": (["fly"], "invalid choice"),
        "missing --config": (["train"], "--config"),
        "dry-run nodes do not divide batch": (
            ["dry-run", "--config", TINY, "--devices", "8", "--nodes", "3"],
            "--nodes 3",
        ),
        "dry-run devices beyond the bound": (
            ["dry-run", "--config", TINY, "--devices", "99999999"],
            "--devices 99999999: must be 1..1024",
        ),
        "dry-run nodes beyond the bound": (
            ["dry-run", "--config", TINY, "--nodes", "99999999"],
            "--nodes 99999999: must be 1..4096",
        ),
        "dry-run unknown step-time mesh": (
            ["dry-run", "--config", TINY, "--step-time-meshes", "hybrid,ring"],
            "mesh names are hybrid, hybrid-m2, hybrid-m1, reference",
        ),
        "plot without metrics": (["plot", base / "tok"], "metrics.jsonl"),
        "neuron_flash without Neuron": (
            t + ["--set", "model.attention=neuron_flash"],
            "[neuron] extra",
        ),
        "render-eks zero nodes": (["render-eks", "--nodes", "0", "--image", "x"], "--nodes 0"),
        "prepare-data missing text": (
            ["prepare-data", base / "missing.txt", "--out", base / "o"],
            "does not exist",
        ),
    }


@pytest.mark.slow
@pytest.mark.xdist_group("trn_cli_done_run")
def test_bad_inputs_one_line_exit_2_nothing_lost(done_run):
    before = _snapshot(done_run / "run")
    cases = _bad_cases(done_run)
    assert len(cases) >= 12
    # Run them two at a time (each is a short Python process).
    procs = {}
    items = list(cases.items())
    for i in range(0, len(items), 2):
        for name, (args, _) in items[i : i + 2]:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "trn_accum.cli", *map(str, args)],
                env=subprocess_env(),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        for name, _ in items[i : i + 2]:
            out, err = procs[name].communicate(timeout=300)
            procs[name] = subprocess.CompletedProcess(args, procs[name].returncode, out, err)
    for name, (_, needle) in cases.items():
        r = procs[name]
        try:
            user_error_line(r, 2, needle)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
    assert _snapshot(done_run / "run") == before


@pytest.mark.xdist_group("trn_cli_done_run")
def test_corrupt_newest_checkpoint_is_one_line_and_kept(done_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(done_run / "run", run)
    newest = run / "checkpoints" / "24" / "state"
    victims = [p for p in newest.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert victims
    for p in victims:
        p.write_bytes(b"\x00garbage" * 3)
    before = _snapshot(run)
    r = train(run, "trainer.steps=30")
    user_error_line(r, 2, str(run / "checkpoints" / "24"))
    assert _snapshot(run) == before


def test_exit_code_constant_matches_checkpoint_module():
    from trn_accum import errors

    assert errors.EXIT_PREEMPTED == errors.EXIT_PREEMPTED == EXIT_PREEMPTED


def test_cpu_fallback_flags_only_on_cpu():
    from trn_accum.cli import cpu_fallback_flags

    flag = "--xla_cpu_enable_concurrency_optimized_scheduler"
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cpu_fallback_flags(env)
    assert f"{flag}=false" in env["XLA_FLAGS"] and "device_count=8" in env["XLA_FLAGS"]
    env = {"XLA_FLAGS": f"{flag}=true --xla_force_host_platform_device_count=4"}
    cpu_fallback_flags(env)  # the user's choice wins
    assert env["XLA_FLAGS"].count(flag) == 1 and f"{flag}=true" in env["XLA_FLAGS"]
    env = {"JAX_PLATFORMS": "neuron,cpu"}
    cpu_fallback_flags(env)  # a Neuron run is left alone
    assert "XLA_FLAGS" not in env


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--", "--config", TINY, "--set", "trainer.notakey=1"], ["trainer.notakey"]),
        (["--", "--config", TINY, "--set", "trainer.steps=abc"], ["trainer.steps", "abc"]),
        (["--", "--config", TINY, "--stepz", "3"], ["--stepz"]),
        (["--", "--config", "configs/nope.toml"], ["configs/nope.toml", "does not exist"]),
        (["--"], ["--config"]),
        (
            ["--only-config-args", "--", "--config", TINY, "--mode", "x", "--set=trainer.steps=a"],
            ["trainer.steps"],
        ),
    ],
)
def test_check_config_refuses_what_train_would(argv, fragments, capsys):
    """`trn-accum check-config -- ARGS`: what `trn-accum train ARGS` refuses at start, one
    line and exit 2, without training (the Slurm script runs it before srun)."""
    from trn_accum import cli as trn_cli

    assert trn_cli.main(["check-config", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trn-accum: error:")
    assert all(f in err for f in fragments), err


def test_check_config_accepts_what_train_accepts(capsys):
    from trn_accum import cli as trn_cli

    ok = ["--config", TINY, "--set", "trainer.steps=3", "--run-dir", "runs/x"]
    assert trn_cli.main(["check-config", "--", *ok]) == 0
    assert capsys.readouterr().out.strip().endswith("with 1 --set override(s): ok on 8 devices")
    # a substituted trainer's own options pass; its --config and --set are still checked
    assert trn_cli.main(["check-config", "--only-config-args", "--", *ok, "--mode", "psum"]) == 0
    assert trn_cli.main(["check-config", "--", *ok, "--mode", "psum"]) == 2


def test_a_closed_stdout_ends_quietly():
    """`trn-accum ... | head -n 0`: the reader of stdout is gone before the command writes
    (a real pipe, its read end closed at once). Exit 0 or 141 (128 + SIGPIPE), nothing on
    stderr (no BrokenPipeError traceback, no 'Exception ignored' at exit)."""
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "trn_accum.cli", "neuron-env"],
            env=subprocess_env(),
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
        os.close(read)  # before the child (still importing) writes a byte
    _, err = child.communicate(timeout=120)
    assert child.returncode in (0, 141), (child.returncode, err[-3000:])
    assert err.strip() == "", err[-3000:]


def test_dry_run_devices_0_is_refused_not_the_default(capsys):
    """`--devices 0` is a value, refused in one line, not "the platform's node" (it ran on 64)."""
    from trn_accum import cli as trn_cli

    assert trn_cli.main(["dry-run", "--config", TINY, "--devices", "0"]) == 2
    assert "--devices 0: must be 1.." in capsys.readouterr().err
