"""The project's sbatch script on a real one-node Slurm (tests/slurm_cluster.py), CPU mode.

Mechanics (a probe program stands in for the trainer through TRN_ACCUM_TRAIN):
- 2 tasks x 4 CPU devices: `trn_accum.cluster.distributed.initialize()` inside srun starts
  jax.distributed with JAX's own Slurm detection; a global sum over the 8 devices is exact.
- `scontrol requeue` + `StartTime=now`: every task gets SIGTERM, the job starts again.
- `scancel --signal=TERM` (what --signal=TERM@120 does at the time-limit warning: the steps
  are signalled, not the batch shell): the tasks exit 75 and the script requeues the job.
- `scancel`: the tasks get SIGTERM, the script does not requeue.

Trainer: the tiny config, 2 tasks x 4 devices, gives the losses of 1 process x 8 devices, and a
run preempted mid-way (`scontrol requeue`) resumes from its checkpoint to the same final loss.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from multiprocess import (
    REPO,
    TINY_SETS,
    TINY_STEPS,
    assert_losses_of_one_process,
    cpu_env,
    tagged_json,
    tiny_reference_losses,
    train_losses,
)
from slurm_cluster import running_cluster
from test_shard_corpus import SHARDS, shard_tokens, write_corpus

from trn_accum.data.datasets import TokenDataset
from trn_accum.data.prepare import prepare_data

SBATCH = REPO / "launch" / "slurm" / "fuji-3b-trn2.sbatch"
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.fixture(scope="module")
def cluster():
    """slurmctld + slurmd on localhost for this module (tests/slurm_cluster.py)."""
    with running_cluster() as c:
        yield c


# Stands in for `trn-accum train`: same arguments, same exit codes (75 after SIGTERM).
PROBE = textwrap.dedent(
    """
    import argparse, json, os, signal, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--config"); p.add_argument("--run-dir"); p.add_argument("--mode")
    a = p.parse_args()
    terms = []
    signal.signal(signal.SIGTERM, lambda *_: terms.append(time.time()))
    rank, start = os.environ["SLURM_PROCID"], os.environ.get("SLURM_RESTART_COUNT", "0")
    run = a.run_dir
    def record(name, text=""):
        with open(os.path.join(run, name), "a") as f:
            f.write(text + "\\n")
    record("starts", f"{rank} {start}")
    result = {"rank": int(rank), "start": int(start), "config": a.config}
    if a.mode == "psum":
        from trn_accum.cluster.distributed import initialize
        info = initialize()
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        local = np.arange(jax.local_device_count(), dtype=np.float32)
        local += jax.local_device_count() * info.process_id
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
        result.update(mode=info.mode, process_index=jax.process_index(),
                      process_count=jax.process_count(), devices=jax.device_count(),
                      local_devices=jax.local_device_count(), sum=float(total))
    elif a.mode == "wait" and start == "0":
        record(f"ready.{rank}")
        deadline = time.time() + 120
        while not terms and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # "saving"
        record(f"term.{rank}.{start}", str(len(terms)))
        print("RESULT", json.dumps(result), flush=True)
        sys.exit(75 if terms else 1)
    print("RESULT", json.dumps(result), flush=True)
    """
)


def job_env(tmp: Path, run_dir: Path, **extra) -> dict[str, str]:
    probe = tmp / "probe.py"
    probe.write_text(PROBE)
    env = cpu_env(4)  # no launcher variables, CPU platform
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        TRN_ACCUM_CPU="1",
        TRN_ACCUM_CPU_DEVICES="4",
        TRN_ACCUM_HOME=str(REPO),
        TRN_ACCUM_RUN_DIR=str(run_dir),
        TRN_ACCUM_TRAIN=f"{sys.executable} {probe}",
    )
    env.update(extra)
    return env


def sbatch(cluster, tmp: Path, env: dict, *args: str, wait: bool = False) -> str:
    """Submit the project's sbatch with 2 tasks on the one node; returns the job id."""
    shape = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--job-name=t"]
    out = cluster.run(
        "sbatch",
        "--parsable",
        *(["--wait"] if wait else []),
        *shape,
        f"--output={tmp}/batch-%j.out",
        str(SBATCH),
        *args,
        env=env,
        cwd=tmp,
        timeout=600,
        check=not wait,
    )
    if wait:
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{cluster.logs()}"
    return out.stdout.strip().splitlines()[0].split(";")[0]


def results(log: Path) -> dict:
    return tagged_json(log.read_text(), "RESULT ")  # gloo shares the ranks' output


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_sbatch_two_ranks_jax_distributed(cluster, tmp_path):
    run = tmp_path / "run"
    job = sbatch(cluster, tmp_path, job_env(tmp_path, run), "--mode", "psum", wait=True)
    assert cluster.job_field(job, "JobState") == "COMPLETED"
    assert cluster.job_field(job, "ExitCode") == "0:0"
    for rank in (0, 1):
        r = results(run / "logs" / f"{job}-r0-{rank}.log")  # one log per rank
        assert r == {
            "rank": rank,
            "start": 0,
            "config": "configs/fuji-tiny.toml",  # CPU mode's default config
            "mode": "slurm",
            "process_index": rank,
            "process_count": 2,
            "devices": 8,
            "local_devices": 4,
            "sum": float(sum(range(8))),  # 28: every device's value, across both processes
        }


def _submit_waiting_job(cluster, tmp_path):
    run = tmp_path / "run"
    job = sbatch(cluster, tmp_path, job_env(tmp_path, run), "--mode", "wait")
    wait_for(lambda: all((run / f"ready.{r}").exists() for r in (0, 1)), 60, "both ranks")
    return job, run


def _batch_log(tmp_path: Path, job: str) -> str:
    return (tmp_path / f"batch-{job}.out").read_text()


def test_requeue_restarts_every_rank(cluster, tmp_path):
    job, run = _submit_waiting_job(cluster, tmp_path)
    cluster.run("scontrol", "requeue", job)
    cluster.wait_state(job, ["PENDING"], 60)
    _start_again_now(cluster, job)
    cluster.wait_state(job, ["COMPLETED"], 60)
    assert sorted((run / "starts").read_text().split("\n")[:-1]) == ["0 0", "0 1", "1 0", "1 1"]
    for rank in (0, 1):
        assert (run / f"term.{rank}.0").read_text().strip() == "1"  # SIGTERM seen, once
        assert results(run / "logs" / f"{job}-r1-{rank}.log")["start"] == 1
    assert cluster.job_field(job, "Restarts") == "1"
    log = _batch_log(tmp_path, job)
    assert "start 0: srun exited 75" in log and "start 1: srun exited 0" in log
    assert "requeueing" not in log  # Slurm requeued it, not the script


def _job_processes(job: str) -> list[int]:
    """Pids on this host of the job: its batch script and steps (SLURM_JOB_ID=`job` in their
    environment) and the slurmstepd daemons that run them (`slurmstepd: [<job>.batch]`,
    `[<job>.0]`: they tear the start down after the script has exited)."""
    mark, stepd = f"SLURM_JOB_ID={job}\0".encode(), f"[{job}.".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if mark in env or (cmd.startswith(b"slurmstepd") and stepd in cmd):
            pids.append(int(pid))
    return pids


def _start_again_now(cluster, job: str) -> None:
    """Start the requeued (PENDING) `job` again now, once its first start is gone: its batch
    script, steps and slurmstepd, and the second in which slurmd revoked its credential (slurmd
    refuses a launch whose credential is not newer than the revocation, in whole seconds:
    `ctime <= revoked` in Slurm's src/common/slurm_cred.c; a start within that second fails)."""
    wait_for(lambda: not _job_processes(job), 60, "the first start's processes to exit")
    gone = int(time.time())
    wait_for(lambda: time.time() >= gone + 2, 5, "the revocation's second to pass")
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def test_time_limit_signal_makes_the_script_requeue(cluster, tmp_path):
    job, run = _submit_waiting_job(cluster, tmp_path)
    # --signal=TERM@120 signals the job steps only; scancel --signal does the same now.
    cluster.run("scancel", "--signal=TERM", job)
    cluster.wait_state(job, ["PENDING"], 60)
    # The script requeues itself and then exits: the job is PENDING before its first start is
    # gone, and a start in that window failed in CI runs (`_start_again_now` waits it out).
    _start_again_now(cluster, job)
    cluster.wait_state(job, ["COMPLETED"], 60)
    assert "saved on the time-limit signal: requeueing" in _batch_log(tmp_path, job)
    assert sorted((run / "starts").read_text().split("\n")[:-1]) == ["0 0", "0 1", "1 0", "1 1"]
    assert cluster.job_field(job, "Restarts") == "1"


def test_scancel_does_not_requeue(cluster, tmp_path):
    job, run = _submit_waiting_job(cluster, tmp_path)
    cluster.run("scancel", job)
    cluster.wait_state(job, ["CANCELLED"], 60)
    wait_for(lambda: "srun exited" in _batch_log(tmp_path, job), 30, "the batch script to end")
    for rank in (0, 1):
        assert (run / f"term.{rank}.0").read_text().strip() == "1"
    assert "requeueing" not in _batch_log(tmp_path, job)
    time.sleep(1)
    assert cluster.job_field(job, "JobState") == "CANCELLED"
    assert len((run / "starts").read_text().split("\n")[:-1]) == 2


# ----------------------------------------------------------------------------- the trainer

STEPS = TINY_STEPS
TRAIN_ARGS = TINY_SETS  # the sbatch adds --config (CPU mode: configs/fuji-tiny.toml)


def trainer_env(tmp: Path, run_dir: Path) -> dict[str, str]:
    env = job_env(tmp, run_dir)
    del env["TRN_ACCUM_TRAIN"]  # the real `trn-accum train`
    return env


@pytest.fixture(scope="module")
def reference_losses() -> dict[int, float]:
    """The tiny config (CPU mode's default) on 1 process x 8 CPU devices."""
    return tiny_reference_losses()


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The project's sbatch in CPU mode, 2 tasks x 4 devices, run to the end: (job, tmp)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = sbatch(cluster, tmp, trainer_env(tmp, tmp / "run"), *TRAIN_ARGS, wait=True)
    return job, tmp


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-6, atol=0)


@pytest.mark.slow  # compiles the tiny train step: 1 process, then 2 ranks
def test_sbatch_trains_with_the_losses_of_one_process(cluster, uninterrupted, reference_losses):
    job, tmp = uninterrupted
    run = tmp / "run"
    assert cluster.job_field(job, "JobState") == "COMPLETED"
    logs = [run / "logs" / f"{job}-r0-{rank}.log" for rank in (0, 1)]
    assert all(p.exists() for p in logs)  # one log per rank
    assert f"done: step {STEPS}" in logs[0].read_text()
    assert_losses_of_one_process(train_losses(run), reference_losses)


@pytest.mark.slow  # two starts of a 2-rank training job
def test_sbatch_preempted_run_resumes_to_the_same_final_loss(
    cluster, tmp_path, uninterrupted, reference_losses
):
    run = tmp_path / "run"
    job = sbatch(cluster, tmp_path, trainer_env(tmp_path, run), *TRAIN_ARGS)
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 600, "a training step")
    cluster.run("scontrol", "requeue", job)  # preemption: SIGTERM to every rank
    cluster.wait_state(job, ["PENDING"], 120)
    _start_again_now(cluster, job)
    cluster.wait_state(job, ["COMPLETED"], 900)

    batch = _batch_log(tmp_path, job)
    assert "start 0: srun exited 75" in batch, batch  # saved on SIGTERM, then exit 75
    assert "start 1: srun exited 0" in batch, batch
    first = (run / "logs" / f"{job}-r0-0.log").read_text()
    second = (run / "logs" / f"{job}-r1-0.log").read_text()
    assert "preempted (signal 15)" in first, first
    m = re.search(r"resumed from .* \(step (\d+)\)", second)
    assert m and 1 <= int(m.group(1)) < STEPS, second  # mid-run, from the preemption save
    got = train_losses(run)
    job0, tmp0 = uninterrupted
    whole = train_losses(tmp0 / "run")
    assert got[STEPS] == pytest.approx(whole[STEPS], rel=1e-6)  # the same final loss
    assert_same_losses(got, whole)  # the same 2 ranks x 4 devices: to float32 rounding
    assert_losses_of_one_process(got, reference_losses)


# ----------------------------------------------------------------------------- static checks


def test_sbatch_header_and_syntax():
    text = SBATCH.read_text()
    directives = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    for want in (
        "--nodes=32",  # the config's node count: 2048 x 8192 tokens with 4 minibatches
        "--ntasks-per-node=1",
        "--exclusive",
        "--requeue",
        "--signal=TERM@120",
    ):
        assert want in directives, f"#SBATCH {want} missing from {SBATCH.name}"
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "source launch/env/trn2.sh" in text
    assert 'srun --cpus-per-task="$cpus_per_task"' in text


def test_slurm_tests_skip_here_but_fail_under_ci(monkeypatch):
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "unavailable_reason", lambda: "no slurm here")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no slurm here"):
        slurm_cluster.require_slurm()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but no slurm here"):
        slurm_cluster.require_slurm()


# ----------------------------------------------------------------------------- launch/env/trn2.sh

TRN2_SH = REPO / "launch" / "env" / "trn2.sh"


def sourced_env(tmp: Path, preset: dict[str, str] | None = None) -> dict[str, str]:
    """The environment after `source launch/env/trn2.sh` under `set -euo pipefail`."""
    # trn-accum (the venv's bin) on PATH: trn2.sh evaluates `trn-accum neuron-env`.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    keep = {"PATH": path, "HOME": str(tmp), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {TRN2_SH}; env -0"],
        env={**keep, **(preset or {})},
        cwd=tmp,
        capture_output=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()
    return dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)


def test_trn2_env_defaults_match_trn_accum_neuron(tmp_path):
    from trn_accum.neuron import platform

    env = sourced_env(tmp_path)
    want = platform.neuron_env(compile_cache=None)  # NEURON_CC_FLAGS, LNC, EFA, ...
    assert {k: env.get(k) for k in want} == want
    assert env["JAX_PLATFORMS"] == "neuron,cpu"
    assert env["NEURON_COMPILE_CACHE_URL"] == f"{tmp_path}/runs/cache/neuron"
    assert env["JAX_COMPILATION_CACHE_DIR"] == f"{tmp_path}/runs/cache/jax"
    assert (tmp_path / "runs" / "cache" / "neuron").is_dir()
    assert not any("--internal-" in env[k] for k in env if k.startswith("NEURON"))


def test_trn2_env_keeps_preset_values(tmp_path):
    preset = {
        "NEURON_CC_FLAGS": "--target=trn2 -O2",
        "NEURON_LOGICAL_NC_CONFIG": "1",
        "NEURON_COMPILE_CACHE_URL": "s3://bucket/neuron-cache",
        "TRN_ACCUM_SHARED_DIR": str(tmp_path / "fsx"),
        "FI_EFA_FORK_SAFE": "0",
        "SLURM_SUBMIT_DIR": str(tmp_path / "elsewhere"),
    }
    env = sourced_env(tmp_path, preset)
    for k, v in preset.items():
        assert env[k] == v
    assert env["JAX_COMPILATION_CACHE_DIR"] == f"{tmp_path}/fsx/cache/jax"
    assert not (tmp_path / "s3:").exists()  # URLs are not created as directories


@pytest.mark.slow
def test_neuron_check_option_fails_the_job_before_training(cluster, tmp_path):
    """TRN_ACCUM_NEURON_CHECK=1 runs the real `trn-accum neuron-check` on every node first; a
    broken piece (here a compiler/runtime LNC pair that disagrees) ends the job with exit 2,
    names the row in the check log, and no training task ever starts."""
    run = tmp_path / "run"
    env = job_env(
        tmp_path,
        run,
        TRN_ACCUM_NEURON_CHECK="1",
        NEURON_LOGICAL_NC_CONFIG="2",
        NEURON_CC_FLAGS="--target=trn2 --lnc=1",
    )
    job = sbatch(cluster, tmp_path, env, "--mode", "psum", wait=False)
    wait_for(lambda: cluster.job_field(job, "JobState") in ("FAILED", "COMPLETED"), 600, "job")
    assert cluster.job_field(job, "ExitCode") == "2:0"
    assert not (run / "starts").exists()  # the trainer never ran
    (log,) = (run / "logs").glob(f"{job}-r0-check-*.log")
    text = log.read_text()
    assert any(x.startswith("FAIL") and " lnc " in x for x in text.splitlines()), text
    assert "neuron-check failed (exit 1), not training" in _batch_log(tmp_path, job)


# ----------------------------------------------------------------------------- the config check

BAD_SETS = [
    (["--set", "trainer.notakey=1"], "trainer.notakey"),
    (["--set", "trainer.steps=abc"], "trainer.steps"),
]


def _script_without_slurm(tmp: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """The sbatch script run by bash outside Slurm, with an `srun` on PATH that only records
    that it was called."""
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "srun").write_text(f"#!/bin/sh\necho srun >> {tmp}/srun-calls\nexit 0\n")
    (fake / "srun").chmod(0o755)
    env = {**env, "PATH": f"{fake}{os.pathsep}{env['PATH']}"}
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=env, cwd=tmp, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("substituted", [False, True], ids=["trainer", "TRN_ACCUM_TRAIN"])
@pytest.mark.parametrize("bad, key", BAD_SETS, ids=["unknown-key", "not-an-int"])
def test_script_refuses_a_bad_set_before_srun(tmp_path, bad, key, substituted):
    """The batch shell checks the config with the trainer's loader before srun starts a rank:
    one line naming the key, exit 2, srun never called, no run directory. A substituted
    trainer (TRN_ACCUM_TRAIN) keeps its own options (--mode) and still gets --set checked."""
    run = tmp_path / "run"
    env = job_env(tmp_path, run)
    extra = ["--mode", "psum"] if substituted else []
    if not substituted:
        del env["TRN_ACCUM_TRAIN"]
    out = _script_without_slurm(tmp_path, env, *extra, *bad)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trn-accum: error:"), out.stderr
    assert key in lines[0]
    assert not (tmp_path / "srun-calls").exists()
    assert not run.exists()


def test_script_passes_a_good_config_to_srun(tmp_path):
    run = tmp_path / "run"
    env = {**job_env(tmp_path, run), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t"}
    out = _script_without_slurm(tmp_path, env, "--mode", "psum", "--set", "trainer.steps=3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check-config: configs/fuji-tiny.toml with 1 --set override(s): ok" in out.stdout
    assert (tmp_path / "srun-calls").read_text().split() == ["srun"]


def test_sbatch_bad_set_fails_the_job_before_any_rank_starts(cluster, tmp_path):
    run = tmp_path / "run"
    env = job_env(tmp_path, run)
    job = sbatch(cluster, tmp_path, env, "--mode", "psum", "--set", "trainer.steps=abc")
    wait_for(lambda: cluster.job_field(job, "JobState") in ("FAILED", "COMPLETED"), 120, "job")
    assert cluster.job_field(job, "ExitCode") == "2:0"
    assert not (run / "starts").exists()  # no rank ever ran
    errors = [ln for ln in _batch_log(tmp_path, job).splitlines() if "error" in ln.lower()]
    assert errors == ["trn-accum: error: trainer.steps = 'abc': must be an integer"], errors


# ----------------------------------------------------------------------------- prepare-data.sbatch

PREPARE_SBATCH = REPO / "launch" / "slurm" / "prepare-data.sbatch"
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _ended_tasks(cluster, job: str) -> list[str]:
    """The JobState of each task of array job `job` that has ended (polled here: `sbatch --wait`
    returned 30 s after such an array's last task ended)."""
    out = cluster.run("scontrol", "-o", "show", "job", job).stdout
    states = [t.partition("=")[2] for t in out.split() if t.startswith("JobState=")]
    return [s for s in states if s in _ENDED]


def test_prepare_data_array_writes_the_shards_of_one_corpus(cluster, tmp_path):
    files = write_corpus(tmp_path)
    prepare_data(files, str(tmp_path / "whole"), workers=1)
    env = cpu_env(1)  # the tasks import trn_accum (and so JAX): CPU, no launcher variables
    env.update(
        TRN_ACCUM_HOME=str(REPO),
        TRN_ACCUM_PREPARE=f"{sys.executable} -m trn_accum.cli prepare-data",
    )
    job = cluster.run(
        "sbatch", "--parsable", f"--array=0-{SHARDS - 1}", "--cpus-per-task=1",
        f"--output={tmp_path}/prepare-%a.out", str(PREPARE_SBATCH),
        "--out", str(tmp_path / "tok"), "--tokenizer", "bytes", *files, env=env, cwd=tmp_path,
    ).stdout.split(";")[0].strip()  # fmt: skip
    wait_for(lambda: len(_ended_tasks(cluster, job)) == SHARDS, 120, "the array's tasks")
    logs = [(tmp_path / f"prepare-{i}.out").read_text() for i in range(SHARDS)]
    assert _ended_tasks(cluster, job) == ["COMPLETED"] * SHARDS, (
        f"{logs}\n{cluster.job_report(job)}"
    )
    shards = [tmp_path / "tok" / f"shard-{i:05d}" for i in range(SHARDS)]
    for i, log in enumerate(logs):
        assert f"shard {i}/{SHARDS} -> {shards[i]}" in log, log
    assert sorted((tmp_path / "tok").iterdir()) == shards
    assert shard_tokens(shards) == (tmp_path / "whole" / "tokens.bin").read_bytes()
    sharded = TokenDataset(str(tmp_path / "tok" / "shard-*"), seq_len=16, batch_size=4)
    whole = TokenDataset(str(tmp_path / "whole"), seq_len=16, batch_size=4)
    assert np.array_equal(sharded.tokens.offsets, whole.tokens.offsets)
    got, want = sharded.rows(5, np.arange(4)), whole.rows(5, np.arange(4))
    assert all(np.array_equal(got[k], want[k]) for k in want)
