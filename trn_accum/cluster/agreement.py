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

__all__ = [
    "ACK_S",
    "Claim",
    "Failure",
    "check_count",
    "decode_claim",
    "decode_hello",
    "disagreement",
    "encode_claim",
    "encode_failure",
    "missing_ranks",
]

_MAGIC = "trn-accum-count/1"
_FAIL_MAGIC = "trn-accum-fail/1"  # a rank that failed at start-up tells the coordinator why
_WAIT = "wait"  # the coordinator's answer to a hello, at once: "I am rank 0, wait for the verdict"
_OK = "ok"
_REFUSE = "refuse "
_MAX_LINE = 4096
_MAX_FAILURE = 2000  # characters of a failure line sent over
ACK_S = 5.0  # a listener that does not say _WAIT within this is not rank 0 (another program)
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


@dataclasses.dataclass(frozen=True)
class Failure:
    """A rank's start-up failure (its config refused, an import error), sent to rank 0."""

    rank: int
    line: str

    def describe(self) -> str:
        return f"rank {self.rank} failed at start-up: {self.line}"


def encode_failure(failure: Failure) -> bytes:
    text = " ".join(failure.line.split())[:_MAX_FAILURE]
    return f"{_FAIL_MAGIC} {failure.rank} {text}\n".encode()


def decode_hello(line: bytes) -> Claim | Failure:
    """The Claim or Failure in one hello line; ValueError if it is neither (a stray
    connection)."""
    if line.startswith(_FAIL_MAGIC.encode() + b" "):
        _, rank, text = line.decode("utf-8", errors="replace").split(" ", 2)
        return Failure(int(rank), text)
    return decode_claim(line)


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


def _read_line(conn: socket.socket, deadline: float, rest: bytearray | None = None) -> bytes:
    """The first line (without its newline) of what arrives before EOF, the limit or
    `deadline`. `rest`: bytes already received after earlier lines; what follows this line is
    left in it for the next call (a peer may send two lines in one segment)."""
    buf = rest if rest is not None else bytearray()
    while b"\n" not in buf and len(buf) < _MAX_LINE:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        chunk = conn.recv(_MAX_LINE)
        if not chunk:
            break
        buf += chunk
    line, _, after = bytes(buf).partition(b"\n")
    buf[:] = after
    return line


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


def _send(conn: socket.socket, text: str) -> bool:
    try:
        conn.sendall(f"{text}\n".encode())
        return True
    except OSError:
        return False


def _coordinate(me: Claim, port: int, timeout: float, failed: str | None = None) -> str | None:
    """Rank 0: collect every rank's hello, answer each _WAIT at once and the verdict when it is
    known. `failed`: rank 0's own start-up failure; then every rank that comes within `timeout`
    is refused at once with it."""
    start = time.monotonic()
    own = None if failed is None else Failure(0, failed).describe()
    server = _listen(port)
    if isinstance(server, str):
        return own or server
    conns: list[socket.socket] = []
    heard: set[int] = set()
    problem = own
    with server:
        try:
            # rank 0's own failure keeps it telling the ranks until all came; any other problem
            # is answered to the waiting ranks at once
            while len(heard) < me.count - 1 and (problem is None or problem == own):
                remaining = start + timeout - time.monotonic()
                if remaining <= 0:
                    problem = problem or missing_ranks(me, heard, time.monotonic() - start)
                    break
                server.settimeout(remaining)
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                try:
                    hello = decode_hello(_read_line(conn, time.monotonic() + 5.0))
                except (OSError, TimeoutError, ValueError):
                    conn.close()  # not a rank (a probe, a port scan): ignore it
                    continue
                if problem is not None:  # rank 0 failed: this rank is told now
                    heard.add(hello.rank)
                    _answer([conn], _REFUSE + problem)
                    continue
                conns.append(conn)
                if isinstance(hello, Failure):
                    problem = hello.describe()
                else:
                    _send(conn, _WAIT)
                    problem = disagreement(me, hello, heard)
                heard.add(hello.rank)
        finally:
            _answer(conns, _OK if problem is None else _REFUSE + problem)
    return problem


def _connect(host: str, port: int, deadline: float, timeout: float) -> socket.socket | None:
    """A connection to host:port, retried until `deadline`; None if it never came."""
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(5.0, timeout)))
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(_RETRY_S)


def _unreachable(address: str, timeout: float, who: str) -> str:
    return (
        f"the coordinator {address} did not answer within {timeout:.0f} s ({who}): rank 0 is "
        f"not listening there (it failed before it could, is not started, or the host or port "
        f"is wrong); start rank 0, and check that the coordinator is rank 0's host"
    )


def _not_rank0(address: str, rank: int) -> str:
    return (
        f"rank 0 is not what listens on the coordinator {address}: another program holds that "
        f"port (it took rank {rank}'s connection but did not answer as trn-accum's rank 0 "
        f"within {ACK_S:.0f} s), so rank 0 cannot bind it; give the coordinator a free port"
    )


def _join(me: Claim, host: str, port: int, timeout: float) -> str | None:
    address = f"{host}:{port}"
    conn = _connect(host, port, time.monotonic() + timeout, timeout)
    if conn is None:
        return _unreachable(address, timeout, me.describe())
    # rank 0 listened before this connection, so it answers by now + timeout at the latest
    answer_by = time.monotonic() + timeout + 5.0
    rest = bytearray()
    with conn:
        try:
            conn.sendall(encode_claim(me))
            first = _read_line(conn, time.monotonic() + min(ACK_S, timeout + 1.0), rest)
            first = first.decode("utf-8", errors="replace")
        except (OSError, TimeoutError):
            first = ""
        if first == _WAIT:
            try:
                verdict = _read_line(conn, answer_by, rest).decode("utf-8", errors="replace")
            except (OSError, TimeoutError):
                verdict = ""
        elif first.startswith(_REFUSE):
            verdict = first
        else:
            return _not_rank0(address, me.rank)
    if verdict == _OK:
        return None
    if verdict.startswith(_REFUSE):
        return verdict[len(_REFUSE) :]
    return (
        f"rank 0 (the coordinator {address}) ended or started without this rank before its "
        f"verdict on the process count ({me.describe()}): see rank 0's line; give every rank "
        f"the same process count and start them together"
    )


def _report(me: Claim, host: str, port: int, timeout: float, failed: str) -> str:
    """A rank other than 0 that failed at start-up: tell rank 0 (which refuses the others),
    return rank 0's verdict (this failure, or an earlier one), else this rank's own line."""
    own = Failure(me.rank, failed)
    conn = _connect(host, port, time.monotonic() + timeout, timeout)
    if conn is None:
        return own.describe()
    with conn:
        try:
            conn.sendall(encode_failure(own))
            verdict = _read_line(conn, time.monotonic() + min(ACK_S, timeout + 1.0))
            verdict = verdict.decode("utf-8", errors="replace")
        except (OSError, TimeoutError):
            verdict = ""
    return verdict[len(_REFUSE) :] if verdict.startswith(_REFUSE) else own.describe()


def check_count(
    me: Claim, coordinator: str, timeout: float, failed: str | None = None
) -> str | None:
    """None when every rank claims the count of rank 0 (`me` is this rank's claim); else the
    one line saying which rank disagrees, failed or never came, within `timeout` seconds.

    Rank 0 listens on the coordinator's port ("host:port") until ranks 1..N-1 reported or one
    disagreed; the others connect to it. Call before `jax.distributed.initialize`.
    `failed`: this rank's own start-up failure (one line): it is passed to every rank (through
    rank 0) instead of a claim, and the returned line names the failing rank.
    """
    if me.count <= 1:
        return None if failed is None else failed
    host, port = coordinator.rsplit(":", 1)
    host = host.strip("[]")
    if me.rank == 0:
        return _coordinate(me, int(port), timeout, failed)
    if failed is not None:
        return _report(me, host, int(port), timeout, failed)
    return _join(me, host, int(port), timeout)
