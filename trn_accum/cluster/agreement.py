"""Every rank agrees on the process count before ``jax.distributed`` starts.

    problem = check_count(Claim(rank, count, "TRN_ACCUM_NUM_PROCESSES"), "host:port", 300)
    # None: every rank claims the same count; else one line for LaunchError (`initialize`)

JAX's coordinator (rank 0) waits for as many processes as *its* count says; the count the other
ranks were given is never compared (measured with jax 0.10.0, two CPU processes):

- rank 0 says 3, rank 1 says 2: both wait for a third process until the initialization timeout
  (300 s), then abort with a C++ check-failure stack; no line names the variable;
- rank 0 says 2, rank 1 says 3: the job runs with 2 processes while rank 1 believes in 3.

So before JAX's service starts, the ranks exchange one line on the coordinator's own port (JAX
binds it only later): every other rank connects to the coordinator (retrying until it listens),
sends its rank and count, and waits for the verdict; the coordinator waits until it has heard
from ranks 1..N-1 or one of them disagrees, answers every rank that is waiting, closes the port
and lets JAX bind it. A disagreement is one line (`LaunchError`) on the coordinator and on every
rank that reached it, naming the variable, both values and the fix, as soon as the disagreeing
rank arrives. A rank that never arrives is named by the coordinator after `timeout` seconds.
The functions return that line (or None); `trn_accum.cluster.distributed` raises it.

Used for the explicit and Kubernetes launches (the count is a variable someone set per rank);
the ranks of one Slurm step all read the same SLURM_NTASKS.
"""

from __future__ import annotations

import dataclasses
import socket
import time

__all__ = ["Claim", "check_count", "decode_claim", "disagreement", "encode_claim", "missing_ranks"]

_MAGIC = "trn-accum-count/1"
_OK = "ok"
_REFUSE = "refuse "
_MAX_LINE = 1024
_RETRY_S = 0.2  # between connection attempts while the coordinator is not up yet


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one rank was told: its rank, the job's process count, and where the count came from
    (e.g. TRN_ACCUM_NUM_PROCESSES, or num_processes for an explicit argument)."""

    rank: int
    count: int
    source: str

    def describe(self) -> str:
        return f"rank {self.rank} has {self.source}={self.count}"


# ----------------------------------------------------------------------------- pure rules


def encode_claim(claim: Claim) -> bytes:
    return f"{_MAGIC} {claim.rank} {claim.count} {claim.source}\n".encode()


def decode_claim(line: bytes) -> Claim:
    """The Claim in one hello line; ValueError if it is not one (a stray connection)."""
    parts = line.decode("ascii").split()
    if len(parts) != 4 or parts[0] != _MAGIC:
        raise ValueError(f"not a {_MAGIC} line: {line[:80]!r}")
    return Claim(int(parts[1]), int(parts[2]), parts[3])


def disagreement(coordinator: Claim, peer: Claim, seen: set[int] = frozenset()) -> str | None:
    """Why `peer` cannot join the coordinator's job (one line), or None if it can."""
    if peer.count != coordinator.count:
        return (
            f"the ranks disagree on the process count: rank 0 (the coordinator) has "
            f"{coordinator.source}={coordinator.count}, {peer.describe()}; give every rank the "
            f"same value, the number of processes the job starts"
        )
    if peer.rank in seen or peer.rank == 0:
        return (
            f"two processes claim rank {peer.rank} of {coordinator.count} (rank 0 is the "
            f"coordinator): give every process its own rank in 0..{coordinator.count - 1}"
        )
    return None


def missing_ranks(coordinator: Claim, heard: set[int], waited_s: float) -> str:
    """The coordinator's line when ranks never arrived within the timeout."""
    missing = sorted(set(range(1, coordinator.count)) - heard)
    names = ", ".join(map(str, missing))
    return (
        f"rank(s) {names} did not reach the coordinator within {waited_s:.0f} s (rank 0 has "
        f"{coordinator.source}={coordinator.count}): start every rank, or set {coordinator.source} "
        f"to the number of processes the job starts"
    )


# ----------------------------------------------------------------------------- the exchange


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    """Bytes up to and including the first newline (or what arrived before EOF/the limit)."""
    buf = b""
    while b"\n" not in buf and len(buf) < _MAX_LINE:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        chunk = conn.recv(_MAX_LINE)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0]


def _listen(port: int) -> socket.socket | str:
    """A listening socket on every address of this host, as JAX's service binds ([::]:port);
    else the line saying why not."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError:
        pass  # no IPv6 here: IPv4 only
    try:
        return socket.create_server(("", port))
    except OSError as e:
        return (
            f"the coordinator port {port} cannot be bound on rank 0's host ({e.strerror}): "
            f"another program uses it; give the coordinator a free port"
        )


def _answer(conns: list[socket.socket], verdict: str) -> None:
    """Send the verdict to every waiting rank; each closes first (no TIME_WAIT on the port)."""
    for conn in conns:
        try:
            conn.sendall(f"{verdict}\n".encode())
            _read_line(conn, time.monotonic() + 5.0)  # until the rank hangs up
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()


def _coordinate(me: Claim, port: int, timeout: float) -> str | None:
    start = time.monotonic()
    server = _listen(port)
    if isinstance(server, str):
        return server
    conns: list[socket.socket] = []
    heard: set[int] = set()
    problem = None
    with server:
        try:
            while problem is None and len(heard) < me.count - 1:
                remaining = start + timeout - time.monotonic()
                if remaining <= 0:
                    problem = missing_ranks(me, heard, time.monotonic() - start)
                    break
                server.settimeout(remaining)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                try:
                    peer = decode_claim(_read_line(conn, time.monotonic() + 5.0))
                except (OSError, TimeoutError, ValueError):
                    conn.close()  # not a rank (a probe, a port scan): ignore it
                    continue
                conns.append(conn)
                problem = disagreement(me, peer, heard)
                heard.add(peer.rank)
        finally:
            _answer(conns, _OK if problem is None else _REFUSE + problem)
    return problem


def _join(me: Claim, host: str, port: int, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    address = f"{host}:{port}"
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(5.0, timeout)))
            break
        except OSError:
            if time.monotonic() >= deadline:
                return (
                    f"the coordinator {address} did not answer within {timeout:.0f} s "
                    f"({me.describe()}): start rank 0, and check that the coordinator is rank "
                    f"0's host"
                )
            time.sleep(_RETRY_S)
    # rank 0 listened before this connection, so it answers by now + timeout at the latest
    answer_by = time.monotonic() + timeout + 5.0
    with conn:
        try:
            conn.sendall(encode_claim(me))
            verdict = _read_line(conn, answer_by).decode("utf-8", errors="replace")
        except (OSError, TimeoutError):
            verdict = ""
    if verdict == _OK:
        return None
    if verdict.startswith(_REFUSE):
        return verdict[len(_REFUSE) :]
    return (
        f"the coordinator {address} gave no verdict on the process count ({me.describe()}): it "
        f"started without this rank or ended; give every rank the same process count and start "
        f"them together"
    )


def check_count(me: Claim, coordinator: str, timeout: float) -> str | None:
    """None when every rank claims the count of rank 0 (`me` is this rank's claim); else the
    one line saying which rank disagrees, or which never came, within `timeout` seconds.

    Rank 0 listens on the coordinator's port ("host:port") until ranks 1..N-1 reported or one
    disagreed; the others connect to it. Call before `jax.distributed.initialize`.
    """
    if me.count <= 1:
        return None
    host, port = coordinator.rsplit(":", 1)
    if me.rank == 0:
        return _coordinate(me, int(port), timeout)
    return _join(me, host.strip("[]"), int(port), timeout)
