"""Ranks that disagree on the process count are named on every rank, before JAX starts.

Pure rules (encode/decode, the lines), the exchange between threads on a free port (no JAX),
and two real `trn-accum train` processes in both directions (rank 0 says 3, rank 1 says 2 and
the reverse): each prints one line naming TRN_ACCUM_NUM_PROCESSES and both values and exits 2.
"""

from __future__ import annotations

import socket
import threading

import pytest
from multiprocess import TINY_CONFIG, free_port, run_processes

from trn_accum.cluster.agreement import (
    Claim,
    check_count,
    decode_claim,
    disagreement,
    encode_claim,
    missing_ranks,
)
from trn_accum.cluster.distributed import derive_launch

VAR = "TRN_ACCUM_NUM_PROCESSES"


def test_claim_round_trip_and_garbage():
    c = Claim(3, 4, VAR)
    assert decode_claim(encode_claim(c).rstrip(b"\n")) == c
    for bad in (b"", b"GET / HTTP/1.1", b"PRI * HTTP/2.0", b"trn-accum-count/1 x 2 V"):
        with pytest.raises(ValueError):
            decode_claim(bad)


def test_disagreement_names_the_variable_and_both_values():
    coord = Claim(0, 3, VAR)
    assert disagreement(coord, Claim(1, 3, VAR)) is None
    line = disagreement(coord, Claim(1, 2, VAR))
    assert f"rank 0 (the coordinator) has {VAR}=3" in line
    assert f"rank 1 has {VAR}=2" in line
    assert "same value" in line and "\n" not in line
    line = disagreement(Claim(0, 2, "num_processes"), Claim(1, 3, VAR))
    assert "num_processes=2" in line and f"{VAR}=3" in line
    assert "two processes claim rank 1" in disagreement(coord, Claim(1, 3, VAR), {1})


def test_missing_ranks_line():
    line = missing_ranks(Claim(0, 4, VAR), {2}, 30.2)
    assert line.startswith("rank(s) 1, 3 did not reach the coordinator within 30 s")
    assert f"{VAR}=4" in line


def test_plan_says_where_the_count_came_from():
    env = {"TRN_ACCUM_PROCESS_ID": "1", VAR: "2", "TRN_ACCUM_COORDINATOR": "h:1"}
    assert derive_launch(env).num_processes_from == VAR
    plan = derive_launch({}, coordinator="h:1", num_processes=2, process_id=0)
    assert plan.num_processes_from == "num_processes"


def _exchange(claims: list[Claim], timeout: float = 30.0, stray: bool = False) -> list:
    """check_count for each claim in its own thread (rank 0 first), on one free port."""
    coord = f"127.0.0.1:{free_port()}"
    out: list = [None] * len(claims)
    started = threading.Event()

    def run(i, claim):
        out[i] = check_count(claim, coord, timeout)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(claims)]
    threads[0].start()
    if stray:  # something that is not a rank connects first (a probe): ignored
        host, port = coord.rsplit(":", 1)
        for _ in range(100):
            try:
                with socket.create_connection((host, int(port)), timeout=1) as s:
                    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    started.set()
                break
            except OSError:
                threading.Event().wait(0.05)
        assert started.is_set()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


def test_ranks_that_agree_pass():
    assert _exchange([Claim(i, 3, VAR) for i in range(3)], stray=True) == [None, None, None]


def test_every_rank_names_a_disagreement():
    got = _exchange([Claim(0, 3, VAR), Claim(1, 2, VAR)])
    assert got[0] == got[1]
    assert f"{VAR}=3" in got[0] and f"{VAR}=2" in got[0]


def test_a_rank_that_never_comes_is_named_after_the_timeout():
    got = _exchange([Claim(0, 3, VAR), Claim(1, 3, VAR)], timeout=1.0)
    assert got[0] == got[1]
    assert got[0].startswith("rank(s) 2 did not reach the coordinator within 1 s")


def test_no_coordinator_is_named_after_the_timeout():
    coord = f"127.0.0.1:{free_port()}"
    line = check_count(Claim(1, 2, VAR), coord, 0.5)
    assert line.startswith(f"the coordinator {coord} did not answer within 0 s")
    assert f"rank 1 has {VAR}=2" in line


def test_the_coordinator_port_in_use_is_named():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        line = check_count(Claim(0, 2, VAR), f"127.0.0.1:{port}", 1.0)
    assert line.startswith(f"the coordinator port {port} cannot be bound")


@pytest.mark.parametrize("counts", [("3", "2"), ("2", "3")], ids=["rank0-says-3", "rank1-says-3"])
def test_two_trainers_that_disagree_each_print_one_line(tmp_path, counts):
    argv = ["-m", "trn_accum.cli", "train", "--config", TINY_CONFIG, "--run-dir", str(tmp_path)]
    results = run_processes(
        argv,
        2,
        per_rank_env=[{VAR: counts[0]}, {VAR: counts[1]}],
        check=False,
        timeout=120,  # far below JAX's 300 s initialization timeout
        grace=60,
    )
    for r in results:
        assert r.returncode == 2, (r.rank, r.stdout[-2000:], r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith("trn-accum: error: the ranks disagree on the process count")
        assert f"rank 0 (the coordinator) has {VAR}={counts[0]}" in lines[0]
        assert f"rank 1 has {VAR}={counts[1]}" in lines[0]
    assert not (tmp_path / "metrics.jsonl").exists()  # no step was trained
