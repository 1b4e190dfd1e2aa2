"""The run directory's owner: one trainer at a time, by a claim file with a heartbeat.

Ownership. One trainer (one job: all its ranks) writes a run directory at a time. Process 0
claims it by creating ``RUN_DIR/owner.json`` atomically: the claim is written to a private
temporary file and hard-linked to that name (``link`` fails if the name exists, atomically, on
local filesystems, NFS and Lustre alike; where hard links are not supported, ``O_CREAT |
O_EXCL``). No ``flock``: it does not work across hosts on every shared filesystem. The claim
holds the host, pid, job id, start time and a heartbeat that a background thread refreshes
every ``HEARTBEAT_S`` seconds (written to a temporary file and renamed over the claim, so a
reader never sees a torn one). The other ranks learn the outcome from one broadcast of
process 0's result, and check that they see the same claim file (the run dir must be shared).

A claim that exists is judged:

- same machine (same kernel boot id and pid namespace, so its ``/proc`` is ours): the owner is
  alive while its pid runs with the recorded start time (a reused pid does not count);
- any other host: alive while its heartbeat is younger than ``STALE_S`` seconds (host clocks
  must agree to well within that bound, as NTP keeps them) and not more than ``MAX_SKEW_S``
  seconds in the future (beyond it: a clock far off or a torn write, judged stale);
- unreadable (garbage): alive while the file was modified less than ``STALE_S`` seconds ago
  (and not beyond ``MAX_SKEW_S`` in the future).

A dead owner's claim is taken over: renamed aside (only one taker can rename it), checked to be
the claim that was judged (else put back), then replaced. A live owner from another job is
refused at once, in one line naming it. A live owner from the same job (a requeued Slurm job,
a restarted Kubernetes pod: same job id) is its previous start, which may still be saving: the
new start waits for it to exit or go stale (at most ``STALE_S`` + ``HEARTBEAT_S`` seconds)
before refusing. The owner releases the claim when it exits, whatever the exit; only SIGKILL
(or a crash of the host) leaves it behind. If the heartbeat finds the claim gone or someone
else's (this trainer was frozen longer than the bound and was taken over), ``Claim.lost``
says so and the trainer stops at the next step boundary without writing more.

The config the run's trajectory was trained with is the other half of its record:
``trn_accum.train.drift``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trn_accum.errors import EXIT_SAVE_FAILED, UserError

CLAIM_FILE = "owner.json"
CLAIM_FORMAT = "trn_accum.claim/1"
HEARTBEAT_S = 15.0  # the owner refreshes its claim this often
STALE_S = 120.0  # a claim from another host whose heartbeat is older than this is dead
MAX_SKEW_S = 60.0  # ... or further in the future than this (clocks that NTP keeps agree far better)
_POLL_S = 2.0


class RunDirError(UserError):
    """The run directory is owned by another trainer, or cannot hold the run's record."""


# ---------------------------------------------------------------------------------------------
# Reading files that may be torn or garbage


def read_json(path: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) when `path` is missing, not a file, not UTF-8 or not
    JSON. Never raises for the content of the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 24)
    except FileNotFoundError:
        return None, "missing"
    except IsADirectoryError:
        return None, "a directory, not a file"
    except OSError as e:
        return None, f"unreadable: {e.strerror}"
    try:
        return json.loads(data.decode("utf-8")), None
    except UnicodeDecodeError:
        return None, "not UTF-8 (torn or garbage)"
    except ValueError:
        return None, "not valid JSON (torn or garbage)"


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (readers see the old or the
    new content, never a part). RunDirError (EXIT_SAVE_FAILED) when it cannot be written."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise RunDirError(
            f"cannot write {path} ({e.strerror}): free space or fix the run dir's storage, then "
            f"run the same command again",
            exit_code=EXIT_SAVE_FAILED,
        ) from None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# Who we are, and whether another claimant is alive


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


def _start_ticks(pid: int) -> int | None:
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
        ticks = _start_ticks(pid)
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


# ---------------------------------------------------------------------------------------------
# The claim


class Claim:
    """The claim of one trainer on `run_dir` (process 0 of a job holds it).

    ``acquire()`` creates or takes over the claim, or raises RunDirError; a daemon thread then
    refreshes the heartbeat. ``lost`` is None while the claim is ours, else why it is not.
    ``release()`` (also on exit of the ``with`` block) stops the thread and removes the claim
    if it is still ours.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        stale_after: float = STALE_S,
        heartbeat_every: float = HEARTBEAT_S,
        env: Mapping[str, str] = os.environ,
        say: Callable[[str], None] = print,
    ):
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.path = os.path.join(self.run_dir, CLAIM_FILE)
        self.stale_after = float(stale_after)
        self.heartbeat_every = float(heartbeat_every)
        self.token = secrets.token_hex(8)
        self.say = say
        pid = os.getpid()
        now = time.time()
        self.record = {
            "format": CLAIM_FORMAT,
            "token": self.token,
            **machine(),
            "pid": pid,
            "start_ticks": _start_ticks(pid),
            "job": job_id(env),
            "since": now,
            "heartbeat": now,
        }
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    # -- acquiring -----------------------------------------------------------------------

    def acquire(self) -> Claim:
        waited_since = None
        for _ in range(10_000):
            if self._create():
                self._start_heartbeat()
                return self
            try:
                with open(self.path, "rb") as f:
                    raw = f.read(1 << 16)
                    mtime = os.fstat(f.fileno()).st_mtime
            except FileNotFoundError:
                continue  # released or taken over meanwhile: try again
            except OSError as e:
                raise RunDirError(
                    f"cannot read the run dir's claim {self.path} ({e.strerror}): fix its "
                    f"permissions or remove it if no trainer uses {self.run_dir}"
                ) from None
            claim, problem = _parse(raw)
            now = time.time()
            alive, why = judge(claim, problem, mtime, now, self.stale_after)
            if not alive:
                if self._take_over(raw):
                    self.say(f"took over {self.path} from {describe(claim)}: {why}")
                continue
            same_job = isinstance(claim, dict) and self.record["job"] is not None
            same_job = same_job and claim.get("job") == self.record["job"]
            limit = self.stale_after + self.heartbeat_every
            if same_job and (waited_since is None or now - waited_since < limit):
                if waited_since is None:
                    waited_since = now
                    self.say(
                        f"waiting up to {limit:.0f} s for the previous start of job "
                        f"{self.record['job']} ({describe(claim)}) to release {self.path}"
                    )
                time.sleep(_POLL_S)
                continue
            raise RunDirError(
                f"run dir {self.run_dir} is in use by another trainer ({describe(claim)}; {why}): "
                f"wait for it to finish or stop it, or pass another --run-dir (its claim "
                f"{self.path} is taken over once its process is gone on this host, or its "
                f"heartbeat is older than {self.stale_after:.0f} s)"
            )
        raise RunDirError(
            f"could not claim {self.path}: it keeps changing; retry"
        )  # pragma: no cover

    def _encoded(self) -> bytes:
        return (json.dumps(self.record) + "\n").encode()

    def _create(self) -> bool:
        """Create the claim atomically; False if a claim exists."""
        tmp = f"{self.path}.{self.token}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self._encoded())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
            try:  # no hard links here: exclusive create (readers may see it empty: "garbage")
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(self._encoded())
            return True
        except OSError as e:
            raise RunDirError(
                f"cannot create the run dir's claim {self.path} ({e.strerror}): pass a writable "
                f"--run-dir"
            ) from None
        finally:
            _remove(tmp)

    def _take_over(self, judged: bytes) -> bool:
        """Move the dead claim aside (one taker wins); put it back if it changed meanwhile."""
        aside = f"{self.path}.stale-{self.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            with open(aside, "rb") as f:
                moved = f.read(1 << 16)
        except OSError:
            moved = b""
        if moved != judged:  # a live claim appeared or beat meanwhile: not ours to remove
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            _remove(aside)
            return False
        _remove(aside)
        return True

    # -- heartbeat -----------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(
            target=self._beat_forever, name="trn-accum-claim-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.heartbeat_every):
            self.beat()
            if self.lost:
                return

    def beat(self) -> None:
        """Refresh the heartbeat if the claim is still ours; else set `lost`."""
        current, problem = read_json(self.path)
        if not isinstance(current, dict) or current.get("token") != self.token:
            owner = describe(current) if problem is None else f"nobody ({problem})"
            self.lost = (
                f"this trainer lost run dir {self.run_dir}: its claim {self.path} now names "
                f"{owner} (this process did not refresh it for more than "
                f"{self.stale_after:.0f} s, so another trainer took over): stopping without "
                f"writing more"
            )
            return
        self.record["heartbeat"] = time.time()
        try:
            write_atomic(self.path, json.dumps(self.record) + "\n")
        except RunDirError as e:
            if not self._warned:  # a full disk: the next beat may succeed
                self.say(f"warning: claim heartbeat not written: {e}")
                self._warned = True

    # -- releasing -----------------------------------------------------------------------

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        current, _ = read_json(self.path)
        if isinstance(current, dict) and current.get("token") == self.token:
            _remove(self.path)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _parse(raw: bytes) -> tuple[Any, str | None]:
    try:
        claim = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, "not a JSON claim: torn or garbage"
    if not isinstance(claim, dict) or claim.get("format") != CLAIM_FORMAT:
        return None, "not a trn_accum claim"
    return claim, None


def claim_for_job(
    run_dir: str, *, say: Callable[[str], None] = print, wait_visible: float = 30.0
) -> Claim | None:
    """Claim `run_dir` for this job: process 0 acquires (or raises RunDirError), one broadcast
    tells the other processes the outcome and the claim's token, and each checks it sees that
    claim (the run dir must be on a filesystem all processes share; NFS may take a few seconds
    to show a new file, so each waits up to `wait_visible` seconds). Returns the Claim on
    process 0, None elsewhere."""
    import jax

    rank, n = jax.process_index(), jax.process_count()
    claim, error = None, None
    if rank == 0:
        try:
            claim = Claim(run_dir, say=say).acquire()
        except RunDirError as e:
            error = e
    if n == 1:
        if error is not None:
            raise error
        return claim
    import numpy as np
    from jax.experimental import multihost_utils

    payload = np.zeros(9, np.uint8)
    if claim is not None:
        payload[0] = 1
        payload[1:] = np.frombuffer(bytes.fromhex(claim.token), np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    if error is not None:
        raise error
    if rank == 0:
        return claim
    if got[0] != 1:
        raise RunDirError(f"process 0 could not claim run dir {run_dir}: see process 0's error")
    token = bytes(got[1:].astype(np.uint8)).hex()
    path = os.path.join(os.path.abspath(run_dir), CLAIM_FILE)
    deadline = time.monotonic() + wait_visible
    while True:
        current, _ = read_json(path)
        if isinstance(current, dict) and current.get("token") == token:
            return None
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise RunDirError(
        f"process {rank} does not see {path} that process 0 wrote: the run dir must be on a "
        f"filesystem shared by all nodes (FSx for Lustre, NFS); pass such a --run-dir"
    )
