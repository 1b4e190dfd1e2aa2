"""An export directory replaced whole: written into a fresh sibling, then swapped in.

    with fresh("exported") as tmp:       # exported/../.exported.tmp-XXXX, stale ones removed
        ...write the files into tmp...
        commit(tmp, "exported", carry)   # fsync, then exchange: the new export is "exported"

`export-hf` never writes into OUT_DIR itself. It writes into ``.<name>.tmp-XXXX`` beside it
(same parent, so same filesystem), fsyncs every file and the directory, then exchanges the two
with one `renameat2(RENAME_EXCHANGE)` (Linux): OUT_DIR is at every instant either the previous
export or the new one, complete, and a kill at any point leaves one of the two there. Where
the system cannot exchange (another OS, or a filesystem without it) OUT_DIR is renamed away
and the new one renamed in: between those two renames OUT_DIR does not exist. The previous
export, now under the temporary name, is removed; a kill before that leaves a hidden
``.<name>.tmp-*`` directory, which the next export removes (`fresh`). A temporary directory
belongs to its process: the export holds an exclusive `flock` on it from its creation to the
swap, and an export removes only the siblings whose lock it can take, so two exports into one
OUT_DIR at once both complete (the later swap wins) and neither removes the other's files.
Files of the previous export that the export does not write (the tokenizer a user copied in)
are carried over (hard links); its weights, index and configs are not, so no stale shard or
index survives.

OUT_DIR must be new, empty, or a Hugging Face checkpoint (config.json or *.safetensors, no
subdirectory): anything else is refused with one line (`check`), so a run dir or a directory
of other files is never replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

from trn_accum.interop.llama import InteropError

TAG = ".tmp-"  # ".<name>.tmp-XXXX": ours, removed by the next export into <name>
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _ours(directory: str) -> tuple[str, re.Pattern]:
    """(the parent of `directory`, the pattern of our temporary siblings' names)."""
    parent, name = os.path.split(os.path.abspath(directory))
    return parent, re.compile(rf"^\.{re.escape(name)}{re.escape(TAG)}[A-Za-z0-9_]+$")


def check(directory: str, looks_exported: Callable[[list[str]], bool]) -> None:
    """InteropError (one line) unless `directory` is missing, empty, or a directory (not a
    link) of files (no subdirectory) whose names `looks_exported`."""
    if not os.path.lexists(directory):
        return
    if os.path.islink(directory):
        where = os.path.realpath(directory)
        raise InteropError(
            f"OUT_DIR {directory} is a symbolic link (to {where}): pass the directory itself"
        )
    if not os.path.isdir(directory):
        raise InteropError(f"OUT_DIR {directory} is a file: pass a directory to export into")
    names = sorted(os.listdir(directory))
    subdirs = [n for n in names if os.path.isdir(os.path.join(directory, n))]
    if subdirs or (names and not looks_exported(names)):
        shown = ", ".join((subdirs or names)[:3]) + (" ..." if len(subdirs or names) > 3 else "")
        why = f"holds subdirectories ({shown})" if subdirs else f"holds other files ({shown})"
        raise InteropError(
            f"OUT_DIR {directory} {why} and is not a Hugging Face checkpoint, which an export "
            f"replaces whole: pass a new or empty directory, or an earlier export"
        )


def _lock(path: str) -> int | None:
    """An open descriptor of the directory `path` holding its exclusive `flock`, taken when
    no other process holds it and `path` still names the directory locked; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None  # gone (removed by its owner or another export), or not a directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            return fd
    except OSError:  # held (a live export's) or removed meanwhile
        pass
    os.close(fd)
    return None


def _remove_stale(directory: str) -> None:
    """Removes the temporary siblings of `directory` that no live export holds (`_lock`):
    those of killed exports, and previous exports left under a temporary name."""
    parent, pattern = _ours(directory)
    for name in os.listdir(parent):
        if not pattern.match(name):
            continue
        fd = _lock(os.path.join(parent, name))
        if fd is None:
            continue
        try:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def fresh(directory: str, tries: int = 100) -> Iterator[str]:
    """A new empty sibling of `directory` to write an export into, held by this process (an
    exclusive `flock` on the directory until the block ends) so that no other export removes
    it, after removing the stale siblings of earlier exports that were killed (which hold no
    lock). OSError when the parent cannot be written."""
    parent, _ = _ours(directory)
    os.makedirs(parent, exist_ok=True)
    _remove_stale(directory)
    name = os.path.basename(os.path.abspath(directory))
    for _ in range(tries):
        tmp = tempfile.mkdtemp(prefix=f".{name}{TAG}", dir=parent)
        fd = _lock(tmp)  # None: another export's `_remove_stale` took it before us
        if fd is not None:
            break
    else:
        raise OSError(errno.EAGAIN, "no temporary directory could be held", parent)
    try:
        yield tmp
    finally:
        os.close(fd)


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps the paths `a` and `b` (Linux `renameat2` with RENAME_EXCHANGE); False,
    with nothing done, when this system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _carry(old: str, new: str, carried: Callable[[str], bool]) -> None:
    """Hard-links (else copies) into `new` the files of `old` that `carried(name)` keeps."""
    for name in sorted(os.listdir(old)) if os.path.isdir(old) else []:
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if carried(name) and os.path.isfile(src) and not os.path.exists(dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def commit(tmp: str, directory: str, carried: Callable[[str], bool]) -> None:
    """Makes the export written in `tmp` (from `fresh`) the content of `directory`: gives its
    files the modes of the umask, carries over the previous export's files that
    `carried(name)` keeps, fsyncs the files and `tmp`, swaps it in, fsyncs the parent,
    removes the previous export."""
    mask = os.umask(0)
    os.umask(mask)  # the modes a plain mkdir / open would give (mkdtemp: 0o700, safetensors: 0o600)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
    os.chmod(tmp, 0o777 & ~mask)
    _carry(directory, tmp, carried)
    for name in os.listdir(tmp):
        _fsync(os.path.join(tmp, name))
    _fsync(tmp, os.O_RDONLY | os.O_DIRECTORY)
    parent, _ = _ours(directory)
    if os.path.isdir(directory) and _exchange(tmp, directory):
        old = tmp  # the exchange left the previous export under the temporary name
    elif os.path.isdir(directory):
        old = f"{tmp}_old"  # one of ours as well: a kill before the rmtree leaves it to `fresh`
        os.rename(directory, old)
        os.rename(tmp, directory)
    else:
        old = None
        os.rename(tmp, directory)
    _fsync(parent, os.O_RDONLY | os.O_DIRECTORY)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
