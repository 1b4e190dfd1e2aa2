"""The checkpoint directory's own hygiene: its step-directory names, a writable directory, and
the leftovers of saves and deletions that were killed, removed when a `Checkpointer` starts.

    freed = remove_leftovers("runs/x/checkpoints")   # [(path, bytes), ...], each logged

Names (orbax's, `orbax.checkpoint` `_src/path/atomicity.py` and `_src/path/step.py`): a save in
progress is written into ``<step>.orbax-checkpoint-tmp`` (older orbax versions add
``-<timestamp>``) and committed by renaming it to ``<step>``; `Checkpointer`'s keep-last-K
renames an old step to ``<step>.orbax-checkpoint-tmp-deleted`` before removing it. A kill in
either window leaves a full-size copy of the state behind, which no later save reuses (the 3B
state is 38 GB). The directory belongs to one trainer at a time (the run dir's claim,
`trn_accum.checkpoint.rundir`), so at start every such directory is a leftover: process 0 removes it
and logs its path and size. A committed step (a name of digits only) is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

log = logging.getLogger("trn_accum.checkpoint.checkpointer")

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax: TMP_DIR_SUFFIX
DELETED_SUFFIX = f"{TMP_SUFFIX}-deleted"  # keep-last-K's rename before rmtree
# "<step>" (committed, or uncommitted on object stores) or "<step>.orbax-checkpoint-tmp..."
STEP_DIR = re.compile(rf"^(\d+)({re.escape(TMP_SUFFIX)}.*)?$")


def make_writable_dir(directory: str) -> None:
    """Creates `directory` (and parents) and proves it writable with a probe file; OSError
    otherwise. Callers turn the OSError into their own one-line error."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def leftovers(directory: str) -> list[str]:
    """Paths of the step directories in `directory` whose name carries orbax's temporary
    suffix (a killed save, or a killed keep-last-K deletion), sorted; never a committed step."""
    out = []
    for name in os.listdir(directory):
        m = STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if m and m.group(2) and os.path.isdir(path) and not os.path.islink(path):
            out.append(path)
    return sorted(out)


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove_leftovers(directory: str) -> list[tuple[str, int]]:
    """Removes `leftovers(directory)`, logging each path and the bytes it freed (a warning);
    one that cannot be removed is a warning naming it, and the run goes on. Returns (path,
    bytes) of each one removed. Call on one process only, before any save starts."""
    freed = []
    for path in leftovers(directory):
        size = tree_bytes(path)
        try:
            shutil.rmtree(path)
        except OSError as e:
            log.warning(
                "leftover checkpoint directory %s (%s) could not be removed (%s): it stays on "
                "disk; remove it by hand",
                path,
                _size(size),
                e.strerror or e,
            )
            continue
        freed.append((path, size))
        log.warning(
            "removed %s, left by a save or deletion that was killed: freed %s", path, _size(size)
        )
    return freed


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
