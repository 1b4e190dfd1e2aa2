"""Issue 38, fault 1: every rank of a 2-process job exits within a minute of any rank's
start-up failure, with one line naming the failing rank and the cause: the coordinator port
held by another program, the coordinator unreachable, the config refused on one rank, an
import error on one rank. Real `trn-accum train` processes (tests/multiprocess.py); the
start-up timeout is lowered through TRN_ACCUM_STARTUP_TIMEOUT, as a user would."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from multiprocess import REPO, TINY_CONFIG, cpu_env, free_port, run_processes

from trn_accum.cluster.agreement import ACK_S

TIMEOUT_S = 8  # TRN_ACCUM_STARTUP_TIMEOUT of these jobs (default 45)
FAST = {"TRN_ACCUM_STARTUP_TIMEOUT": str(TIMEOUT_S)}

# `trn-accum train` whose config differs by rank: rank R's --set comes from BAD_SET_<R>
TRAIN_BY_RANK = f"""
import os, sys
from trn_accum import cli
rank = os.environ["TRN_ACCUM_PROCESS_ID"]
sets = os.environ.get("BAD_SET_" + rank, "data.seed=0")
sys.exit(cli.main(["train", "--config", {TINY_CONFIG!r}, "--set", sets,
                   "--run-dir", os.environ["RUN_DIR"] + "/" + rank]))
"""


def _one_line(r) -> str:
    """The rank's single stderr line (a user error: exit 2, no traceback)."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.rank, r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, (r.rank, r.stderr[-3000:])
    assert lines[0].startswith("trn-accum: error: ")
    return lines[0]


def _job(tmp_path, *, env=None, per_rank_env=None):
    t0 = time.monotonic()
    results = run_processes(
        TRAIN_BY_RANK,
        2,
        env={**FAST, "RUN_DIR": str(tmp_path), **(env or {})},
        per_rank_env=per_rank_env,
        timeout=120,
        check=False,
    )
    return results, time.monotonic() - t0


def test_coordinator_port_held_by_another_program(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as other:  # listens, never answers
        port = other.getsockname()[1]
        results, took = _job(tmp_path, env={"TRN_ACCUM_COORDINATOR": f"127.0.0.1:{port}"})
    zero, one = map(_one_line, results)
    assert f"the coordinator port {port} cannot be bound on rank 0's host" in zero, zero
    assert f"rank 0 is not what listens on the coordinator 127.0.0.1:{port}" in one, one
    assert "another program holds that port" in one and f"{ACK_S:.0f} s" in one, one
    assert took < 60


@pytest.mark.parametrize("bad_rank", ["0", "1"])
def test_config_refused_on_one_rank(tmp_path, bad_rank):
    results, took = _job(tmp_path, env={f"BAD_SET_{bad_rank}": "data.seed=-1"})
    lines = [_one_line(r) for r in results]
    assert lines[0] == lines[1], lines  # the same line everywhere
    assert lines[0].startswith(f"trn-accum: error: rank {bad_rank} failed at start-up: ")
    assert "data.seed = -1" in lines[0], lines
    assert took < 60


def test_import_error_on_one_rank(tmp_path):
    broken = tmp_path / "site"
    (broken / "optax").mkdir(parents=True)  # a broken install of a dependency on rank 1's node
    (broken / "optax" / "__init__.py").write_text("raise ImportError('optax is half-installed')")
    path = f"{broken}:{REPO}"
    results, took = _job(tmp_path, per_rank_env=[{}, {"PYTHONPATH": path}])
    lines = [_one_line(r) for r in results]
    assert lines[0] == lines[1], lines
    assert "rank 1 failed at start-up: cannot import the trainer" in lines[0], lines
    assert "optax is half-installed" in lines[0], lines
    assert took < 60


def test_coordinator_unreachable(tmp_path):
    """Rank 1 alone: rank 0 never listens (its host is down, or it died before listening)."""
    port = free_port()
    env = cpu_env(
        4,
        {
            **FAST,
            "TRN_ACCUM_COORDINATOR": f"127.0.0.1:{port}",
            "TRN_ACCUM_NUM_PROCESSES": "2",
            "TRN_ACCUM_PROCESS_ID": "1",
        },
    )
    argv = ["train", "--config", TINY_CONFIG, "--run-dir", str(tmp_path / "run")]
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    r.rank = 1
    line = _one_line(r)
    assert f"the coordinator 127.0.0.1:{port} did not answer within {TIMEOUT_S} s" in line
    assert "rank 0 is not listening there" in line, line
    assert TIMEOUT_S <= took < 60


def test_failure_hello_round_trip():
    from trn_accum.cluster.agreement import (
        Claim,
        Failure,
        decode_hello,
        encode_claim,
        encode_failure,
    )

    f = Failure(3, "config file 'x.toml'\n  does not name [trainer]")
    got = decode_hello(encode_failure(f).rstrip(b"\n"))
    assert got == Failure(3, "config file 'x.toml' does not name [trainer]")
    assert got.describe().startswith("rank 3 failed at start-up: config file")
    assert decode_hello(encode_claim(Claim(1, 2, "V")).rstrip(b"\n")) == Claim(1, 2, "V")
    with pytest.raises(ValueError):
        decode_hello(b"trn-accum-fail/1 x")
