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
``trn_accum.config.drift``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trn_accum.checkpoint.liveness import describe, job_id, judge, machine, process_start_ticks
from trn_accum.errors import EXIT_SAVE_FAILED, UserError

CLAIM_FILE = "owner.json"
CLAIM_FORMAT = "trn_accum.claim/1"
HEARTBEAT_S = 15.0  # the owner refreshes its claim this often
STALE_S = 120.0  # a claim from another host whose heartbeat is older than this is dead
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
            "start_ticks": process_start_ticks(pid),
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
