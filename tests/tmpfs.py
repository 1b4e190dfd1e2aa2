"""A real, small tmpfs for the disk-full tests.

    with small_tmpfs(tmp_path / "mnt", 2_500_000) as mnt:   # a filesystem of 2.5 MB
        ...
        resize(mnt, 20_000_000)                             # "the user freed space"

Mounting needs root. Elsewhere the test skips with the reason, except under `CI=true`, where it
fails (as the Slurm tests do): CI must run it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int):
    """Mount a tmpfs of `size_bytes` at `path` (created) for the block; unmount after."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        _unavailable("not root: cannot mount a small tmpfs for the disk-full test")
    if not shutil.which("mount"):
        _unavailable("no mount command: cannot mount a small tmpfs for the disk-full test")
    opts = f"size={int(size_bytes)}"
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode:
        _unavailable(f"`mount -t tmpfs -o {opts}` failed: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize(path: Path, size_bytes: int) -> None:
    """Grow (or shrink) a tmpfs mounted by `small_tmpfs`, keeping its files."""
    subprocess.run(["mount", "-o", f"remount,size={int(size_bytes)}", str(path)], check=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
