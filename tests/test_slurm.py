"""The project's sbatch script on a real one-node Slurm (tests/slurm_cluster.py), CPU mode.

Mechanics (a probe program stands in for the trainer through TRN_ACCUM_TRAIN):
- 2 tasks x 4 CPU devices: `trn_accum.distributed.initialize()` inside srun starts
  jax.distributed with JAX's own Slurm detection; a global sum over the 8 devices is exact.
- `scontrol requeue` + `StartTime=now`: every task gets SIGTERM, the job starts again.
- `scancel --signal=TERM` (what --signal=TERM@120 does at the time-limit warning: the steps
  are signalled, not the batch shell): the tasks exit 75 and the script requeues the job.
- `scancel`: the tasks get SIGTERM, the script does not requeue.

Trainer: the tiny config, 2 tasks x 4 devices, gives the losses of 1 process x 8 devices, and a
run preempted mid-way (`scontrol requeue`) resumes from its checkpoint to the same final loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from multiprocess import REPO, cpu_env
from slurm_cluster import slurm_cluster  # noqa: F401  (fixture)

SBATCH = REPO / "launch" / "slurm" / "fuji-3b-trn2.sbatch"
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.xdist_group("slurm")

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
        from trn_accum.distributed import initialize
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
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT in {log}:\n{log.read_text()}"
    return json.loads(lines[-1][len("RESULT ") :])


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_sbatch_two_ranks_jax_distributed(slurm_cluster, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    job = sbatch(slurm_cluster, tmp_path, job_env(tmp_path, run), "--mode", "psum", wait=True)
    assert slurm_cluster.job_field(job, "JobState") == "COMPLETED"
    assert slurm_cluster.job_field(job, "ExitCode") == "0:0"
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


def test_requeue_restarts_every_rank(slurm_cluster, tmp_path):  # noqa: F811
    job, run = _submit_waiting_job(slurm_cluster, tmp_path)
    slurm_cluster.run("scontrol", "requeue", job)
    slurm_cluster.wait_state(job, ["PENDING"], 60)
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    slurm_cluster.wait_state(job, ["COMPLETED"], 60)
    assert sorted((run / "starts").read_text().split("\n")[:-1]) == ["0 0", "0 1", "1 0", "1 1"]
    for rank in (0, 1):
        assert (run / f"term.{rank}.0").read_text().strip() == "1"  # SIGTERM seen, once
        assert results(run / "logs" / f"{job}-r1-{rank}.log")["start"] == 1
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    log = _batch_log(tmp_path, job)
    assert "start 0: srun exited 75" in log and "start 1: srun exited 0" in log
    assert "requeueing" not in log  # Slurm requeued it, not the script


def test_time_limit_signal_makes_the_script_requeue(slurm_cluster, tmp_path):  # noqa: F811
    job, run = _submit_waiting_job(slurm_cluster, tmp_path)
    # --signal=TERM@120 signals the job steps only; scancel --signal does the same now.
    slurm_cluster.run("scancel", "--signal=TERM", job)
    slurm_cluster.wait_state(job, ["PENDING"], 60)
    slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    slurm_cluster.wait_state(job, ["COMPLETED"], 60)
    assert "saved on the time-limit signal: requeueing" in _batch_log(tmp_path, job)
    assert sorted((run / "starts").read_text().split("\n")[:-1]) == ["0 0", "0 1", "1 0", "1 1"]
    assert slurm_cluster.job_field(job, "Restarts") == "1"


def test_scancel_does_not_requeue(slurm_cluster, tmp_path):  # noqa: F811
    job, run = _submit_waiting_job(slurm_cluster, tmp_path)
    slurm_cluster.run("scancel", job)
    slurm_cluster.wait_state(job, ["CANCELLED"], 60)
    wait_for(lambda: "srun exited" in _batch_log(tmp_path, job), 30, "the batch script to end")
    for rank in (0, 1):
        assert (run / f"term.{rank}.0").read_text().strip() == "1"
    assert "requeueing" not in _batch_log(tmp_path, job)
    time.sleep(1)
    assert slurm_cluster.job_field(job, "JobState") == "CANCELLED"
    assert len((run / "starts").read_text().split("\n")[:-1]) == 2


# ----------------------------------------------------------------------------- the trainer


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[int(rec["step"])] = float(rec["loss"])
    return out


_ = (subprocess, np)
