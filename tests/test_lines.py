"""Issue 47: a host whose own name gives gloo (JAX's CPU collectives) no address to listen on
is one line on every rank, checked before JAX's distributed start, not a gloo traceback. (The
issue's other lines, a config file's byte order mark and a key set in the wrong section:
tests/test_reliability_config.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from multiprocess import TINY_CONFIG, run_processes

from trn_accum.cluster.distributed import gloo_address_problem, gloo_in_use

NO_SUCH_HOST = "no-such-host.invalid"  # RFC 6761: .invalid never resolves


def test_unresolvable_hostname_is_one_line_naming_it_and_the_fix():
    line = gloo_address_problem(NO_SUCH_HOST)
    assert line is not None and "\n" not in line
    assert f"this host's name {NO_SUCH_HOST!r} does not resolve" in line, line
    assert "gloo" in line and f"{NO_SUCH_HOST}' to /etc/hosts" in line, line


def test_hostname_of_another_host_is_refused_and_localhost_passes():
    """192.0.2.1 (TEST-NET-1) resolves to itself but is no address of this host: gloo's bind
    fails there too. localhost resolves and binds everywhere."""
    line = gloo_address_problem("192.0.2.1")
    assert line is not None and "resolves to 192.0.2.1, no address of this host" in line, line
    assert gloo_address_problem("localhost") is None


@pytest.mark.parametrize(
    "platforms, collectives, used",
    [
        (None, "gloo", True),  # every platform starts, CPU among them
        ("cpu", "gloo", True),
        ("neuron,cpu", "gloo", True),
        ("neuron", "gloo", False),  # no CPU backend: no gloo
        ("cpu", "mpi", False),
        ("cpu", None, False),
    ],
)
def test_gloo_in_use(platforms, collectives, used):
    assert gloo_in_use(platforms, collectives) is used


# each rank renames its host in a UTS namespace of its own (root only), as a container runtime
# that leaves the name out of /etc/hosts would, then runs `trn-accum train`
TRAIN_ON_NAMELESS_HOST = f"""
import ctypes, os, socket, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x04000000) != 0:  # CLONE_NEWUTS
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))
socket.sethostname({NO_SUCH_HOST!r})
from trn_accum import cli
sys.exit(cli.main(["train", "--config", {TINY_CONFIG!r}, "--run-dir",
                   os.environ["RUN_DIR"] + "/" + os.environ["TRN_ACCUM_PROCESS_ID"]]))
"""


def _can_rename_host() -> bool:
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x04000000) != 0)"
    return sys.platform == "linux" and subprocess.run([sys.executable, "-c", probe]).returncode == 0


@pytest.mark.skipif(not _can_rename_host(), reason="needs a UTS namespace (root on Linux)")
def test_trainer_on_a_host_whose_name_does_not_resolve(tmp_path):
    """Every rank of a real 2-process job exits 2 with the same one line, no gloo traceback."""
    results = run_processes(
        TRAIN_ON_NAMELESS_HOST,
        2,
        env={"RUN_DIR": str(tmp_path), "TRN_ACCUM_STARTUP_TIMEOUT": "8"},
        timeout=120,
        check=False,
    )
    lines = []
    for r in results:
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(err) == 1, (r.rank, r.returncode, r.stderr[-3000:])
        lines.append(err[0])
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("trn-accum: error: rank 0 failed at start-up: "), lines
    assert f"this host's name {NO_SUCH_HOST!r} does not resolve" in lines[0], lines
    assert not os.listdir(tmp_path)  # refused before the run directory was touched
