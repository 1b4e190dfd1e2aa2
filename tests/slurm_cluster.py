"""A real one-node Slurm (slurmctld + slurmd on localhost) in a temporary folder, for the tests.

Recipe: Debian's slurm-wlm 22.05, run as root, `AuthType=auth/none`,
`CredType=cred/none`, `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`,
`SelectType=select/cons_tres`, one node `localhost` with `CPUs=2` and `RealMemory` from
/proc/meminfo, free (non-default) ports, every state/spool/pid/log path inside the folder.
Clients find it through `SLURM_CONF` (see `SlurmCluster.env`).

Use it as a fixture (the daemons are stopped by PID at teardown)::

    from slurm_cluster import running_cluster

    @pytest.fixture(scope="module")
    def cluster():
        with running_cluster() as c:
            yield c

    @pytest.mark.xdist_group("slurm")
    def test_x(cluster):
        cluster.run("sbatch", "--wait", "job.sh")

(or import the session-scoped `slurm_cluster` fixture from this module).

When slurm-wlm is missing (or we are not root) the fixture skips with the reason, except under
`CI=true`, where it fails: CI must run these tests (`make test` installs slurm-wlm there).

By hand: `python tests/slurm_cluster.py` starts one and prints the `SLURM_CONF` to export;
Ctrl-C stops it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "sacct")


def unavailable_reason() -> str | None:
    """Why a local Slurm cannot run here (None when it can)."""
    missing = [b for b in DAEMONS + CLIENTS[:5] if shutil.which(b) is None]
    if missing:
        return (
            f"slurm-wlm is not installed (missing {', '.join(missing)}): run "
            "`bash launch/local/install-system-deps.sh` as root on Debian/Ubuntu"
        )
    if os.geteuid() != 0:
        return "the local Slurm test cluster runs slurmd as root; this process is not root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _real_memory_mb() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return max(256, int(line.split()[1]) // 1024 - 512)
    return 1024


class SlurmCluster:
    """slurmctld + slurmd for one node `localhost` with `cpus` CPUs, rooted at `root`."""

    def __init__(self, root: str | os.PathLike, *, cpus: int = 2, kill_wait: int = 30):
        self.root = Path(root)
        self.cpus = int(cpus)
        self.kill_wait = int(kill_wait)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.first_job_id = random.randrange(1_000, 1_000_000)

    # ---------------------------------------------------------------- configuration
    def config_text(self, ctld_port: int, slurmd_port: int) -> str:
        r = self.root
        return "\n".join(
            [
                "ClusterName=trnaccumtest",
                # JAX's Slurm detection puts the coordinator on port JOBID % 4096 + 61440: a
                # random first job id keeps two clusters on one machine (parallel test runs)
                # from sharing coordinator ports.
                f"FirstJobId={self.first_job_id}",
                "SlurmctldHost=localhost",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/none",
                "CredType=cred/none",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/backfill",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "JobCompType=jobcomp/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                f"KillWait={self.kill_wait}",
                "MinJobAge=600",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool'}",
                f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'slurmd.pid'}",
                f"SlurmctldLogFile={r / 'slurmctld.log'}",
                f"SlurmdLogFile={r / 'slurmd.log'}",
                f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} "
                f"RealMemory={_real_memory_mb()} State=UNKNOWN",
                "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ plus SLURM_CONF (and `extra`), minus any SLURM_* of an enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    # ---------------------------------------------------------------- life cycle
    def start(self, timeout: float = 30.0) -> SlurmCluster:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self.config_text(*_free_ports(2)))
        env = self.env()
        for name, argv in (
            ("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)]),
            ("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)]),
        ):
            log = open(self.root / f"{name}.stdout", "wb")
            self.procs[name] = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self.logs()}")
            out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if out == "idle":
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Slurm did not become idle in {timeout:.0f} s: {self.logs()}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the daemons we started (by PID), then SIGKILL what is left."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def logs(self, tail: int = 4000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.stdout", "slurmd.stdout"):
            p = self.root / name
            if p.exists():
                parts.append(f"--- {name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # ---------------------------------------------------------------- clients
    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; text output captured."""
        proc = subprocess.run(
            list(argv),
            env=self.env(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}\nstdout: {proc.stdout}\n"
                f"stderr: {proc.stderr}\n{self.logs()}"
            )
        return proc

    def job_field(self, job_id: str | int, field: str) -> str:
        """One field of `scontrol show job` (e.g. JobState, Restarts, ExitCode)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        for tok in out.split():
            key, _, value = tok.partition("=")
            if key == field:
                return value
        raise KeyError(f"{field} not in scontrol output: {out}")

    def wait_state(self, job_id: str | int, states: Sequence[str], timeout: float = 60.0) -> str:
        """Poll until the job's JobState is one of `states`; returns it."""
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(0.2)
        raise TimeoutError(
            f"job {job_id} still {state} after {timeout:.0f} s, wanted {states}\n"
            + self.job_report(job_id)
        )

    def job_report(self, job_id: str | int) -> str:
        """`scontrol show job` and the daemons' log lines that name the job (for a failure)."""
        lines = [self.run("scontrol", "show", "job", str(job_id), check=False).stdout]
        for name in ("slurmctld.log", "slurmd.log"):
            log = self.root / name
            text = log.read_text(errors="replace") if log.exists() else ""
            lines += [f"--- {name}"] + [ln for ln in text.splitlines() if str(job_id) in ln][-40:]
        return "\n".join(lines)


def require_slurm() -> None:
    """Skip (fail under CI=true) when a local Slurm cannot run here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def running_cluster(**kwargs) -> Iterator[SlurmCluster]:
    """A started SlurmCluster in a temporary folder (skips/fails per `require_slurm`); its
    daemons are stopped by PID on exit."""
    require_slurm()
    with tempfile.TemporaryDirectory(prefix="trn-accum-slurm-") as root:
        cluster = SlurmCluster(root, **kwargs).start()
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running one-node Slurm for the session (`running_cluster`)."""
    with running_cluster() as cluster:
        yield cluster


if __name__ == "__main__":
    reason = unavailable_reason()
    if reason:
        raise SystemExit(reason)
    root = tempfile.mkdtemp(prefix="trn-accum-slurm-")
    c = SlurmCluster(root).start()
    print(f"export SLURM_CONF={c.conf}   # Ctrl-C stops slurmctld and slurmd", flush=True)
    try:
        while all(p.poll() is None for p in c.procs.values()):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
