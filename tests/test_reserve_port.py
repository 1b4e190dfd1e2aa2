"""launch/slurm/reserve-port.sh: the root port reserved from the ephemeral range where the job
may (root), appended to the list already there; one line where it may not. Run on a stand-in
for /proc/sys/net/ipv4/ip_local_reserved_ports (a temporary file), as root (directly, or in a
user namespace where root maps to this user) and as nobody."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from trn_accum.cluster import rootport
from trn_accum.cluster.distributed import DEFAULT_NEURON_ROOT_PORT

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "slurm" / "reserve-port.sh"
SBATCH = REPO / "launch" / "slurm" / "fuji-3b-trn2.sbatch"


def as_root(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return cmd
    if not shutil.which("unshare"):
        pytest.skip("not root and no unshare for a user namespace")
    return ["unshare", "--user", "--map-root-user", *cmd]


def as_nobody(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def proc_file(tmp_path: Path, text: str) -> Path:
    tmp_path.chmod(0o755)  # readable by nobody too
    f = tmp_path / "ip_local_reserved_ports"
    f.write_text(text + "\n")
    f.chmod(0o644)
    return f


@pytest.mark.parametrize(
    "before, after",
    [
        ("", "41000"),
        ("8080", "8080,41000"),
        ("8080,50000-50010", "8080,50000-50010,41000"),
    ],
)
def test_root_appends_the_port_to_the_list(tmp_path, before, after):
    f = proc_file(tmp_path, before)
    out = run(as_root(["bash", str(SCRIPT), "41000", str(f)]))
    assert out.returncode == 0, out.stderr
    assert f.read_text().strip() == after  # the existing list kept, the port appended
    assert rootport.port_reserved(41000, f.read_text())
    assert all(
        rootport.port_reserved(p, f.read_text()) for p, _ in rootport.parse_port_list(before)
    )
    (line,) = out.stdout.splitlines()
    assert "reserved port 41000" in line and after in line


@pytest.mark.parametrize("before", ["41000", "8080,40000-42000", "40999-41000"])
def test_already_reserved_is_left_alone(tmp_path, before):
    f = proc_file(tmp_path, before)
    out = run(as_root(["bash", str(SCRIPT), "41000", str(f)]))
    assert out.returncode == 0 and f.read_text().strip() == before
    assert rootport.port_reserved(41000, before)  # the Python reader agrees
    (line,) = out.stdout.splitlines()
    assert "already reserved" in line


def test_not_root_says_so_in_one_line_and_changes_nothing():
    with tempfile.TemporaryDirectory() as d:  # in /tmp: nobody can reach it (tmp_path: 0700)
        _not_root(Path(d))


def _not_root(tmp_path: Path):
    f = proc_file(tmp_path, "8080")
    # nobody may not reach the checkout (a clone in a 0700 temporary folder): run a copy
    script = tmp_path / SCRIPT.name
    shutil.copyfile(SCRIPT, script)
    script.chmod(0o755)
    out = run(as_nobody(["bash", str(script), "41000", str(f)]))
    assert out.returncode == 0, out.stderr
    assert f.read_text().strip() == "8080"
    (line,) = out.stdout.splitlines()
    assert "cannot reserve port 41000" in line
    # the fix an administrator would run keeps the list there
    assert "sysctl -w net.ipv4.ip_local_reserved_ports=8080,41000" in line


def test_unreadable_file_and_bad_port(tmp_path):
    out = run(["bash", str(SCRIPT), "41000", str(tmp_path / "absent")])
    assert out.returncode == 0
    (line,) = out.stdout.splitlines()
    assert "not reserved" in line and "absent" in line
    for bad in ("", "0", "65536", "41x", "-1"):
        out = run(["bash", str(SCRIPT), bad, str(tmp_path / "absent")])
        assert out.returncode == 2 and "1-65535" in out.stderr, bad
        assert len(out.stderr.strip().splitlines()) == 1


def test_sbatch_reserves_the_trainers_root_port_on_neuron_runs():
    text = SBATCH.read_text()
    call = re.search(r'reserve-port\.sh "\$\{TRN_ACCUM_NEURON_ROOT_PORT:-(\d+)\}"', text)
    assert call, "the sbatch script does not run reserve-port.sh"
    assert int(call.group(1)) == DEFAULT_NEURON_ROOT_PORT  # one value, Python's
    # on every node, before the training step, not in CPU mode
    neuron_block = text[text.index('if [[ "${TRN_ACCUM_CPU:-0}" != 1 ]]') : call.end()]
    assert '--ntasks-per-node=1 --ntasks="${SLURM_JOB_NUM_NODES:-1}"' in neuron_block
    assert call.start() < text.index('"${train[@]}"')
    assert os.access(SCRIPT, os.X_OK)
    assert run(["bash", "-n", str(SCRIPT)]).returncode == 0


@pytest.mark.parametrize(
    "text, port, want",
    [
        ("", 41000, False),
        ("41000", 41000, True),
        ("1-5,40000-42000", 41000, True),
        ("1-5,40000-42000", 42001, False),
        (" 8080 ,9148\n", 9148, True),
    ],
)
def test_port_list_reader(text, port, want):
    assert rootport.port_reserved(port, text) is want


def test_port_list_reader_rejects_garbage():
    with pytest.raises(ValueError, match="'a-b'"):
        rootport.parse_port_list("8080,a-b")


def test_neuron_mode_script_reserves_before_the_training_step(tmp_path):
    """The sbatch script in Neuron mode run by bash outside Slurm, with an `srun` that records
    its arguments: the reservation step (one task per node, the root port) comes first."""
    import sys

    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "srun-calls"
    (fake / "srun").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    (fake / "srun").chmod(0o755)
    venv = Path(sys.executable).parent
    env = {
        "PATH": f"{fake}{os.pathsep}{venv}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "TRN_ACCUM_HOME": str(REPO),
        "TRN_ACCUM_RUN_DIR": str(tmp_path / "run"),
        "TRN_ACCUM_SHARED_DIR": str(tmp_path / "shared"),  # trn2.sh's compile caches
        "TRN_ACCUM_NEURON_ROOT_PORT": "42424",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "t",
        "SLURM_JOB_NUM_NODES": "3",
    }
    out = subprocess.run(
        ["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "--ntasks-per-node=1 --ntasks=3 launch/slurm/reserve-port.sh 42424"
    assert "trn-accum train" in lines[1]  # the training step, after
