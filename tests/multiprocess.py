"""Run N JAX processes on localhost, joined by `jax.distributed`, for the tests.

    results = run_processes(CODE, 2, devices_per_process=4)   # CODE: python source
    assert all(r.returncode == 0 for r in results)

Each process is `python -c CODE` (or `python ARGV...`) with the CPU platform, its own emulated
device count (the suite's 8 are replaced), and the explicit launch variables that
`trn_accum.cluster.distributed.initialize()` reads: TRN_ACCUM_COORDINATOR=127.0.0.1:<free port>,
TRN_ACCUM_NUM_PROCESSES=N, TRN_ACCUM_PROCESS_ID=i (Slurm and Kubernetes variables removed).
If any process fails, the others are killed (by PID) and `ProcessesFailed` shows every output;
on timeout all are killed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def train_cli(
    args: Sequence[str],
    *,
    devices: int = 8,
    env: Mapping[str, str] | None = None,
    timeout: float = 900.0,
) -> subprocess.CompletedProcess:
    """`trn-accum train ARGS` in one CPU process with `devices` emulated devices."""
    return subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", "train", *args],
        env=cpu_env(devices, env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# A short run of the tiny config (4 minibatches per step) shared by the trainer-level tests.
# 10 steps: 2 processes and 1 process agree to ~1e-7 here; over more steps bf16 rounding
# differences grow (measured: 1e-5 by step 16), so longer runs are compared on one topology.
TINY_CONFIG = "configs/fuji-tiny.toml"
TINY_STEPS = 10
TINY_SETS = [
    "--set",
    f"trainer.steps={TINY_STEPS}",
    "--set",
    "trainer.log_every=1",
    "--set",
    "trainer.eval_every=1000",
    "--set",
    "checkpoint.every=1000",  # the only mid-run checkpoint is a preemption save
]


def assert_losses_of_one_process(got: Mapping[int, float], want: Mapping[int, float]) -> None:
    """The tiny run on 2 processes x 4 devices against 1 process x 8 (`tiny_reference_losses`):
    every step logged; the first loss (same parameters, same rows, before any update) to float32
    rounding, the later ones within 1e-4 relative. They may drift by more than rounding: the
    reductions can sum in another order when a process holds 4 devices instead of 8, and bf16
    training steps amplify it (measured on an AVX-512/AMX host: 2.2e-5 relative at step 10,
    from step 6 on). A wrong row, shard or step shows at step 1, by far more than 1e-6."""
    assert sorted(got) == sorted(want) == list(range(1, TINY_STEPS + 1))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=0)
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-4, atol=0)


@functools.cache
def tiny_reference_losses() -> dict[int, float]:
    """{step: loss} of TINY_SETS on 1 process x 8 CPU devices (computed once per process:
    the tests that use it share the xdist group "slurm", hence one worker)."""
    with tempfile.TemporaryDirectory(prefix="trn-accum-ref-") as run:
        out = train_cli(["--config", TINY_CONFIG, *TINY_SETS, "--run-dir", run], devices=8)
        if out.returncode != 0:
            raise AssertionError(f"reference run failed:\n{out.stderr[-3000:]}")
        losses = train_losses(run)
    if sorted(losses) != list(range(1, TINY_STEPS + 1)):
        raise AssertionError(f"reference run logged steps {sorted(losses)}")
    return losses


def train_losses(run_dir: str | os.PathLike) -> dict[int, float]:
    """{step: loss} of the train records in RUN_DIR/metrics.jsonl."""
    import json

    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[int(rec["step"])] = float(rec["loss"])
    return out


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ for a CPU JAX process with `devices` emulated devices, no launcher vars."""
    drop = ("SLURM_", "JOB_COMPLETION_INDEX", "TRN_ACCUM_", "NEURON_PJRT_", "JAX_COORDINATOR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclasses.dataclass
class ProcResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    def tagged(self, tag: str) -> str:
        """`tagged(self.stdout, tag)`, naming this rank when the tag is missing."""
        try:
            return tagged(self.stdout, tag)
        except AssertionError as e:
            raise AssertionError(f"rank {self.rank}: {e}") from None


def tagged(stdout: str, tag: str) -> str:
    """The rest of the last stdout line after `tag`. C++ libraries such as gloo write to a
    rank's stdout from their own threads, between the pieces of a Python `print`, so a line's
    head (or tail) can be theirs: results are printed after a tag, found anywhere in a line."""
    lines = [ln for ln in stdout.splitlines() if tag in ln]
    if not lines:
        raise AssertionError(f"no {tag!r} line in stdout:\n{stdout[-3000:]}")
    return lines[-1].rpartition(tag)[2].strip()


def tagged_json(stdout: str, tag: str):
    """The JSON value printed after `tag` (`tagged`), anything a C++ thread wrote after it on
    the same line ignored."""
    return json.JSONDecoder().raw_decode(tagged(stdout, tag))[0]


class ProcessesFailed(AssertionError):
    def __init__(self, why: str, results: Sequence[ProcResult]):
        parts = [why]
        for r in results:
            parts.append(
                f"--- rank {r.rank} exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\n"
                f"stderr:\n{r.stderr[-3000:]}"
            )
        super().__init__("\n".join(parts))
        self.results = list(results)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: the group id is its PID
        except ProcessLookupError:
            pass
        p.wait()


def run_processes(
    code: str | Sequence[str],
    n: int,
    *,
    devices_per_process: int = 4,
    env: Mapping[str, str] | None = None,
    per_rank_env: Sequence[Mapping[str, str]] | None = None,
    timeout: float = 120.0,
    grace: float = 10.0,
    check: bool = True,
    cwd: str | os.PathLike | None = None,
) -> list[ProcResult]:
    """Start `n` processes, wait for all, return their results (rank order).

    code: python source (run with -c) or an argv after the interpreter (e.g. ["-m", "x"]).
    env / per_rank_env: extra variables for all / for rank i.
    check: raise ProcessesFailed if any exits non-zero (the rest are killed `grace` seconds
      after the first failure) or on timeout.
    """
    argv = [sys.executable, "-c", code] if isinstance(code, str) else [sys.executable, *code]
    port = free_port()
    procs, files = [], []
    with tempfile.TemporaryDirectory(prefix="trn-accum-mp-") as tmp:
        try:
            for i in range(n):
                e = cpu_env(
                    devices_per_process,
                    {
                        "TRN_ACCUM_COORDINATOR": f"127.0.0.1:{port}",
                        "TRN_ACCUM_NUM_PROCESSES": str(n),
                        "TRN_ACCUM_PROCESS_ID": str(i),
                        **(env or {}),
                        **(per_rank_env[i] if per_rank_env else {}),
                    },
                )
                out = open(Path(tmp) / f"{i}.out", "w+b")
                err = open(Path(tmp) / f"{i}.err", "w+b")
                files.append((out, err))
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=e,
                        cwd=cwd or REPO,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            first_failure: float | None = None
            why = ""
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    why = f"timeout after {timeout:.0f} s"
                    break
                failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = now
                    why = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
                if first_failure is not None and now - first_failure > grace:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        results = []
        for i, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(
                ProcResult(
                    i,
                    p.returncode,
                    out.read().decode(errors="replace"),
                    err.read().decode(errors="replace"),
                )
            )
            out.close()
            err.close()
    if check and (why or any(r.returncode != 0 for r in results)):
        raise ProcessesFailed(why or "a process failed", results)
    return results
