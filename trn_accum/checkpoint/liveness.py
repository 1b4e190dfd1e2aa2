"""Whether the owner of a run directory's claim is alive: who this process is (host, boot,
pid and its start time, job), and a claim read from disk judged by pid on the same machine, by
heartbeat age elsewhere (clocks may be skewed by up to MAX_SKEW_S)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

MAX_SKEW_S = 60.0  # ... or further in the future than this (clocks that NTP keeps agree far better)


def job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """This process's job as the scheduler names it: ``TRN_ACCUM_JOB_ID``, the Slurm job id,
    the Kubernetes Job name (``TRN_ACCUM_JOB_NAME``, set by `trn-accum render-eks`), or None."""
    if env.get("TRN_ACCUM_JOB_ID"):
        return env["TRN_ACCUM_JOB_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if env.get("JOB_COMPLETION_INDEX") is not None and env.get("TRN_ACCUM_JOB_NAME"):
        return f"k8s:{env['TRN_ACCUM_JOB_NAME']}"
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None
    when it does not run (gone, or a zombie)."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def machine() -> dict[str, Any]:
    """What identifies the process namespace we run in: host name, kernel boot id, pid
    namespace (the last two are None off Linux)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "host": socket.gethostname(),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
    }


def _same_machine(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(k) and a.get(k) == b.get(k) for k in ("host", "boot_id", "pidns"))


def _pid_alive(pid: Any, start_ticks: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        ticks = process_start_ticks(pid)
        return ticks is not None and (not isinstance(start_ticks, int) or ticks == start_ticks)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fresh(age: float, stale_after: float) -> bool:
    """A heartbeat (or modification) `age` seconds old counts as alive: not older than
    `stale_after`, not further than MAX_SKEW_S in the future (NaN: neither)."""
    return -MAX_SKEW_S <= age <= stale_after


def _age_text(age: float) -> str:
    if age < -MAX_SKEW_S:
        return f"{-age:.0f} s in the future (beyond the {MAX_SKEW_S:.0f} s clock-skew bound)"
    return f"{age:.0f} s old"


def judge(claim: Any, problem: str | None, mtime: float, now: float, stale_after: float):
    """(alive, why) for a claim read from disk (`claim` None with `problem` when unreadable)."""
    if problem is not None or not isinstance(claim, dict):
        age = now - mtime
        why = f"an unreadable claim file ({problem or 'not a JSON object'}), modified " + (
            _age_text(age).replace(" old", " ago")
        )
        return _fresh(age, stale_after), why
    me = machine()
    if _same_machine(claim, me):
        alive = _pid_alive(claim.get("pid"), claim.get("start_ticks"))
        return alive, f"pid {claim.get('pid')} on this host is {'running' if alive else 'gone'}"
    beat = claim.get("heartbeat")
    age = now - beat if isinstance(beat, int | float) else float("inf")
    why = f"its heartbeat is {_age_text(age)} (stale after {stale_after:.0f} s)"
    return _fresh(age, stale_after), why


def describe(claim: Any) -> str:
    """`host h, pid p, job j, since <UTC time>` of a claim (whatever fields it has)."""
    if not isinstance(claim, dict):
        return "an unknown owner"
    since = claim.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        if isinstance(since, int | float)
        else "?"
    )
    return (
        f"host {claim.get('host', '?')}, pid {claim.get('pid', '?')}, job "
        f"{claim.get('job') or 'none'}, since {when}"
    )
