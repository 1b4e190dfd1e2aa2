"""The programs in examples/ run as a user runs them (a fresh Python each) and pass their own
check against the full batch (exit status 0)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_the_four_examples_are_there():
    assert EXAMPLES == ["axlearn_style.py", "equinox_mlp.py", "flax_nnx.py", "optax_step.py"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_matches_the_full_batch(name):
    env = dict(os.environ)  # conftest's XLA_FLAGS (8 devices): the example keeps them
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max relative error vs the full batch" in proc.stdout, proc.stdout
    assert "AuxReductionWarning" not in proc.stderr, proc.stderr
