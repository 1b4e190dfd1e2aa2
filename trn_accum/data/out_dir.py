"""The output directory of `prepare-data`: one writer at a time, files it owns, and a publish
that never mixes two runs or loses the earlier output.

    with OutDir(out, inputs) as d:          # lock taken, foreign files refused, stale temps gone
        d.temp("tokens.bin")                # "OUT/tokens.bin.tmp.<host>.<pid>.<random>"
        d.publish({"tokens.bin": ..., "meta.json": ...})   # renames, meta.json last

Rules, each a one-line `DataError` that replaces nothing:

- the lock: `OutDir` takes an exclusive `fcntl.flock` on `OUT/.prepare-data.lock` (created),
  which records the holder's pid, host and start time; a second run into the same `--out` is
  refused naming them. The lock file is removed when the run ends (success or failure); a
  holder checks that the file it locked is still the one at that name, so a run that raced
  the removal locks again.
- `--out` may hold only what prepare-data writes (`tokens.bin`, `offsets.npy`, a `meta.json`
  of this package's format, the lock and temporary files); anything else (a dataset card, the
  corpus itself) is refused, as is `--out` being the directory of an input file.
- temporary names carry the run's host, pid and a random tag, so two runs never write one
  file even where the lock does not reach (a file system without working `flock`); the files
  are flushed to disk before the renames; `meta.json` goes first and comes back last, so a run
  stopped between two renames leaves a directory without `meta.json` (never one that looks
  complete), and the loader refuses a `meta.json` whose files are not the ones it vouches for
  (`tokens.read_meta`: sizes and sampled digests).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import secrets
import socket

from trn_accum.data.tokens import FORMAT, META_FILE, OFFSETS_FILE, TOKENS_FILE, DataError

LOCK_FILE = ".prepare-data.lock"
#: the final names prepare-data writes, and the raw offsets it streams into first
OWNED = (TOKENS_FILE, OFFSETS_FILE, META_FILE)
RAW_OFFSETS = "offsets.int64"
_KINDS = (*OWNED, RAW_OFFSETS)
_TMP = ".tmp"


def temp_kind(name: str) -> str | None:
    """ "tokens.bin.tmp" for "tokens.bin.tmp" or "tokens.bin.tmp.<run tag>", else None."""
    for kind in _KINDS:
        stem = kind + _TMP
        if name == stem or name.startswith(stem + "."):
            return stem
    return None


def interrupted_files(out_dir: str) -> list[str]:
    """The kinds of temporary file ("tokens.bin.tmp", ...) that runs which did not finish left
    in `out_dir` (the next run removes them)."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return []
    found = {temp_kind(n) for n in names}
    return [k + _TMP for k in _KINDS if k + _TMP in found]


def _foreign(out_dir: str) -> list[str]:
    """The entries of `out_dir` prepare-data did not write."""
    found = []
    for name in sorted(os.listdir(out_dir)):
        if name == META_FILE:
            try:
                with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                    ours = json.load(f).get("format") == FORMAT
            except (OSError, ValueError, AttributeError):
                ours = False
            if not ours:
                found.append(name)
        elif name not in (*OWNED, LOCK_FILE) and temp_kind(name) is None:
            found.append(name)
    return found


def check_out(out_dir: str, inputs: list[str]) -> None:
    """DataError when `out_dir` is the directory of one of `inputs`."""
    out = os.path.realpath(out_dir)
    for path in inputs:
        if os.path.dirname(os.path.realpath(path)) == out:
            raise DataError(
                f"--out {out_dir} is the directory of the input {path}: prepare-data would "
                f"write beside (and could replace) the corpus; choose a new or empty --out"
            )


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "a run that is starting"
    except OSError:
        return "another run"


class OutDir:
    """`out_dir`, locked for this run (a context manager; see the module docstring)."""

    def __init__(self, out_dir: str, inputs: list[str]):
        check_out(out_dir, inputs)
        self.path = out_dir
        self.tag = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
        self._fd = -1

    def temp(self, name: str) -> str:
        return os.path.join(self.path, f"{name}{_TMP}.{self.tag}")

    def _lock(self) -> None:
        lock = os.path.join(self.path, LOCK_FILE)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise DataError(
                    f"--out {self.path} is being written by another prepare-data "
                    f"({_holder(lock)}): wait for it to finish, or choose another --out"
                ) from None
            try:
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder removed it as we opened it: lock the new one
                break
            os.close(fd)
        self._fd = fd
        since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {since}".encode())

    def __enter__(self) -> OutDir:
        try:
            os.makedirs(self.path, exist_ok=True)
            self._lock()
            foreign = _foreign(self.path)
        except BaseException as e:
            self._unlock()
            if not isinstance(e, OSError):
                raise
            raise DataError(
                f"output directory {self.path} cannot be created or locked ({e.strerror}): "
                f"choose a writable --out"
            ) from None
        if foreign:
            self._unlock()
            raise DataError(
                f"--out {self.path} holds files prepare-data did not write "
                f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}): choose a "
                f"new or empty --out (nothing was replaced)"
            )
        self.stale = interrupted_files(self.path)
        self.remove_temps(every=True)
        return self

    def remove_temps(self, *, every: bool = False) -> None:
        """Removes this run's temporary files (`every`: any run's; only under the lock)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if temp_kind(name) and (every or name.endswith("." + self.tag)):
                _remove(os.path.join(self.path, name))

    def publish(self, files: dict[str, str]) -> None:
        """Moves `files` (final name -> this run's temporary path) into place, flushed to disk
        first; meta.json is removed first and renamed last."""
        for tmp in files.values():
            _fsync(tmp)
        _remove(os.path.join(self.path, META_FILE))
        for name in sorted(files, key=lambda n: n == META_FILE):
            os.replace(files[name], os.path.join(self.path, name))
        _fsync(self.path)

    def _unlock(self) -> None:
        if self._fd >= 0:
            _remove(os.path.join(self.path, LOCK_FILE))
            os.close(self._fd)  # closing releases the flock
            self._fd = -1

    def __exit__(self, *exc) -> None:
        try:
            self.remove_temps()
        finally:
            self._unlock()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
