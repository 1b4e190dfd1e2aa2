"""A run dir that survives a cluster, end to end through `trn-accum train` in subprocesses:
two trainers started together (one refused in one line, the other's metrics complete), a
killed trainer's claim taken over, config drift refused then allowed (and recorded), elastic
resume 8 devices x k=4 -> 4 devices x k=8 with the same float32 losses, a full disk on a real
small tmpfs (exit 74, previous checkpoint intact, no partial step directory), garbage bytes in
the files read back, a run whose every step is non-finite stopping in one line, and old
checkpoints that cannot be deleted costing the new one nothing."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, subprocess_env, user_error_line
from tmpfs import resize, small_tmpfs

from trn_accum.errors import EXIT_SAVE_FAILED, EXIT_USAGE
from trn_accum.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
# 8 steps in float32 with checkpoints at 4 and 8: the uninterrupted reference run
BASE = [
    "trainer.steps=8",
    "checkpoint.every=4",
    "checkpoint.keep=2",
    "trainer.log_every=1",
    'model.compute_dtype="float32"',
]


def _argv(run_dir, sets, allow=(), fault=None):
    cmd = [sys.executable, "-m", "trn_accum.cli"]
    if fault:
        cmd = [sys.executable, str(ROOT / "tests" / "fault_driver.py"), fault, "--"]
    args = ["train", "--config", TINY, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    if allow:
        args += ["--allow-config-change", *allow]
    return cmd + args


def train(run_dir, *sets, devices=8, allow=(), fault=None):
    return subprocess.run(
        _argv(run_dir, sets, allow, fault),
        env=subprocess_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


cli = run_cli


def _train_steps_in_file_order(run_dir):
    return [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def _train_records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}


def _snapshot(path):
    out = {}
    for p in sorted(Path(path).rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The uninterrupted reference: 8 devices, k=4, float32, 8 steps, checkpoints 4 and 8."""
    run = tmp_path_factory.mktemp("base") / "run"
    r = train(run, *BASE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _train_steps_in_file_order(run) == list(range(1, 9))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "8"]
    assert not (run / "owner.json").exists()  # released at exit
    return run


def _copy(run, dest):
    shutil.copytree(run, dest)
    return dest


# ---------------------------------------------------------------------------------------------
# One owner at a time


@pytest.mark.slow
def test_two_trainers_started_together_one_refused_other_complete(tmp_path):
    run = tmp_path / "run"
    sets = ["trainer.steps=6", "checkpoint.every=3", "trainer.log_every=1"]
    procs = [
        subprocess.Popen(
            _argv(run, sets),
            env=subprocess_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    assert sorted(r.returncode for r in done) == [0, EXIT_USAGE], [r.stderr[-2000:] for r in done]
    winner = procs[[r.returncode for r in done].index(0)]
    loser = done[[r.returncode for r in done].index(EXIT_USAGE)]
    line = user_error_line(loser, EXIT_USAGE, f"run dir {run} is in use by another trainer")
    assert f"pid {winner.pid}" in line and "job none" in line and "since " in line
    assert "--run-dir" in line  # the fix
    assert _train_steps_in_file_order(run) == [1, 2, 3, 4, 5, 6]  # complete, once each
    assert not (run / "owner.json").exists()


@pytest.mark.slow
def test_killed_trainers_claim_is_taken_over_and_metrics_stay_unique(tmp_path):
    run = tmp_path / "run"
    sets = ["trainer.steps=8", "checkpoint.every=2", "trainer.log_every=1"]
    r = train(run, *sets, fault="sigkill_after_step=5")
    assert r.returncode == -9, r.stderr[-3000:]
    ghost = json.loads((run / "owner.json").read_text())  # SIGKILL: the claim stays behind
    r = train(run, *sets)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"took over {run / 'owner.json'}" in r.stdout
    assert f"pid {ghost['pid']} on this host is gone" in r.stdout
    assert "(step 4)" in r.stdout or "(step 2)" in r.stdout, r.stdout
    assert _train_steps_in_file_order(run) == list(range(1, 9))  # unique and ordered
    assert not (run / "owner.json").exists()


# ---------------------------------------------------------------------------------------------
# Config drift, elastic resume


@pytest.mark.slow
def test_config_drift_refused_then_allowed_and_recorded(base, tmp_path):
    """A resume with another data seed and learning rate is refused, nothing touched; allowed,
    it runs (garbage bytes in metrics.jsonl and config.json are no obstacle), the change is
    logged, and the new values become the record."""
    run = _copy(base, tmp_path / "run")
    changed = [*BASE, "trainer.steps=10", "data.seed=1", "optimizer.peak_lr=0.001"]
    before = _snapshot(run)
    r = train(run, *changed)
    user_error_line(
        r,
        EXIT_USAGE,
        f"resuming run dir {run} at step 8 would change its trajectory",
        "data.seed 0 -> 1",
        "optimizer.peak_lr 0.003 -> 0.001",
        "--allow-config-change data.seed optimizer.peak_lr",
    )
    assert _snapshot(run) == before

    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 9, "kind": "tr\xff\xfe\x00 torn write\n\x80\x81garbage\n')
    (run / "config.json").write_bytes(b"\x00\xffnot json")
    r = train(run, *changed, allow=["data.seed", "optimizer"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "config changed from step 8 on (allowed): data.seed 0 -> 1" in r.stdout
    rows = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 8
    assert rows[0]["changes"] == {
        "data.seed": {"old": 0, "new": 1},
        "optimizer.peak_lr": {"old": 0.003, "new": 0.001},
    }
    assert json.loads((run / "config.json").read_text())["data"]["seed"] == 1
    assert _train_steps_in_file_order(run) == list(range(1, 11))
    r = train(run, *changed)  # the new values are the record now
    assert r.returncode == 0 and "already at step 10" in r.stdout, r.stderr[-3000:]
    r = train(run, *BASE, "trainer.steps=10")  # and the old ones drift from it
    user_error_line(r, EXIT_USAGE, "data.seed 1 -> 0")
    assert cli("plot", run).returncode == 0


@pytest.mark.slow
def test_elastic_resume_half_the_devices_twice_the_accumulation(base, tmp_path):
    """Saved on 8 devices with k=4; resumed on 4 with k=8 (same global batch, same rows per
    minibatch and device): steps 5..8 match the uninterrupted run (float32, rel 1e-5)."""
    run = _copy(base, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "8")
    r = train(run, *BASE, "trainer.accum_steps=8", devices=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(step 4)" in r.stdout and "on 4 cpu devices" in r.stdout
    assert "mesh {'data': 2, 'fsdp': 2, 'model': 1}" in r.stdout and "in 8 minibatches" in r.stdout
    ref, got = _train_records(base), _train_records(run)
    assert _train_steps_in_file_order(run) == list(range(1, 9))
    for s in range(5, 9):
        for key in ("loss", "grad_norm"):
            assert got[s][key] == pytest.approx(ref[s][key], rel=1e-5), (s, key)
        assert got[s]["lr"] == ref[s]["lr"] and got[s]["target_tokens"] == ref[s]["target_tokens"]


# ---------------------------------------------------------------------------------------------
# Full disk, garbage files, non-finite runs


@pytest.mark.slow
def test_disk_full_on_a_small_tmpfs(tmp_path):
    """A filesystem with room for one checkpoint of the tiny state (1.6 MB): the save of step 4
    fails in the background; the trainer stops at the next step boundary (before the next
    save) with one line naming the path and the cause, exit 74; checkpoint 2 is intact and no
    partial step directory is left; with space again, the same command resumes from step 2."""
    sets = ["trainer.steps=8", "checkpoint.every=2", "checkpoint.keep=1", "trainer.log_every=1"]
    with small_tmpfs(tmp_path / "mnt", 2_500_000) as mnt:
        run = mnt / "run"
        r = train(run, *sets)
        ck = run / "checkpoints"
        user_error_line(
            r,
            EXIT_SAVE_FAILED,
            f"checkpoint {ck / '4'} could not be written (No space left on device)",
            f"the previous checkpoint {ck / '2'} is intact",
        )
        assert sorted(os.listdir(ck)) == ["2"]  # no 4.orbax-checkpoint-tmp
        logged = _train_steps_in_file_order(run)
        assert logged[:4] == [1, 2, 3, 4] and max(logged) < 6, logged  # stopped before step 6
        resize(mnt, 20_000_000)
        r = train(run, *sets)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"resumed from {ck / '2'} (step 2)" in r.stdout
        assert "uncommitted" not in r.stderr and "Traceback" not in r.stderr
        assert _train_steps_in_file_order(run) == list(range(1, 9))


@pytest.mark.slow
def test_metrics_file_replaced_by_a_directory_is_one_line(base, tmp_path):
    run = _copy(base, tmp_path / "run")
    os.remove(run / "metrics.jsonl")
    (run / "metrics.jsonl").mkdir()
    r = train(run, *BASE, "trainer.steps=10")
    user_error_line(r, EXIT_USAGE, f"{run / 'metrics.jsonl'} is a directory")
    assert not (run / "owner.json").exists()
    user_error_line(cli("plot", run), EXIT_USAGE, "is a directory")


def test_binary_config_and_prepare_data_of_a_directory(tmp_path):
    binary = tmp_path / "c.toml"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    user_error_line(cli("train", "--config", binary), EXIT_USAGE, "not UTF-8")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("hello")
    r = cli("prepare-data", docs, "--out", tmp_path / "tok")
    user_error_line(r, EXIT_USAGE, f"text file {docs} is a directory")


def test_run_dir_path_that_is_not_utf8_is_one_line_before_training(tmp_path):
    """orbax/tensorstore store paths as UTF-8: such a run dir would train and then fail every
    save; it is refused at start, nothing created."""
    run = os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\xffx")
    r = cli("train", "--config", TINY, "--run-dir", run, "--set", "trainer.steps=1")
    user_error_line(r, EXIT_USAGE, "has the byte b'\\xff', which is not UTF-8", "--run-dir")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_every_step_non_finite_stops_in_one_line(tmp_path):
    """init_std 1e30 overflows every forward pass: all 4 steps are skipped; the run is
    shorter than trainer.stop_after_nonfinite (100), so all of them count: it stops at step
    4 with the step, the count and what to check, instead of reporting success."""
    run = tmp_path / "run"
    r = train(run, "trainer.steps=4", "model.init_std=1e30", "trainer.log_every=1")
    user_error_line(
        r,
        EXIT_USAGE,
        "step 4: the last 4 steps (1..4) were all skipped as non-finite",
        "optimizer.peak_lr",
        "model.init_std (1e+30)",
    )
    assert [r["skipped_steps"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert "done" not in r.stdout


@pytest.mark.slow
def test_undeletable_old_checkpoints_do_not_cost_the_new_one(tmp_path):
    """keep=2 with old steps 1 and 2 that cannot be deleted (`chattr +i`): a resume to 4
    commits 3 and 4, warns once per old step (naming it and its path), exits 0; the next
    resume starts from step 4, and with the old steps deletable again keep=2 holds."""
    from test_checkpoint import _undeletable

    sets = ["checkpoint.every=1", "checkpoint.keep=2", "trainer.log_every=1"]
    run = tmp_path / "run"
    ck = run / "checkpoints"
    r = train(run, *sets, "trainer.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(ck)) == ["1", "2"]
    with _undeletable(ck / "1", ck / "2"):
        r = train(run, *sets, "trainer.steps=4")
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
        assert "Traceback" not in r.stderr and "could not be written" not in r.stderr
        for step in (1, 2):
            lines = [ln for ln in r.stderr.splitlines() if f"step {step} at {ck / str(step)}" in ln]
            assert len(lines) == 1 and "could not be deleted" in lines[0], r.stderr[-3000:]
        assert sorted(os.listdir(ck)) == ["1", "2", "3", "4"]
    r = train(run, *sets, "trainer.steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ck / '4'} (step 4)" in r.stdout
    assert "could not be deleted" not in r.stderr
    assert sorted(os.listdir(ck)) == ["4", "5"]
    assert _train_steps_in_file_order(run) == list(range(1, 6))
