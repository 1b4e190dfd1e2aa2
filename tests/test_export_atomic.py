"""`export-hf`'s output directory is replaced whole (`trn_accum.interop.out_dir`): a kill at any
file-system call leaves the previous export or the new one, complete; the next export leaves no
hidden leftovers; stale shards and indexes never survive; a directory that is not an export is
refused. Pure file-system tests on tiny tensors (no JAX)."""

import os
import re
import shutil
from contextlib import contextmanager

import numpy as np
import pytest

from trn_accum.interop import hf_io, out_dir
from trn_accum.interop.llama import InteropError

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


class Killed(BaseException):
    """A kill: not an OSError, so no cleanup path of the writer runs for it."""


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal((8, 16)).astype(np.float32) for i in range(5)}


def export(directory, values, max_bytes, extra=None):
    sizes = {n: v.nbytes for n, v in values.items()}
    return hf_io.write_checkpoint(
        str(directory), CONFIG, sizes, values.__getitem__, max_bytes=max_bytes, extra=extra
    )


def snapshot(directory) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def hidden(directory) -> list[str]:
    return [n for n in os.listdir(directory.parent) if n.startswith(f".{directory.name}.")]


# what the writer calls that changes the file system; a kill lands before any one of them
CALLS = [
    (os, "mkdir"),
    (os, "rename"),
    (os, "link"),
    (os, "chmod"),
    (os, "fsync"),
    (shutil, "rmtree"),
    (shutil, "copy2"),
    (hf_io, "save_file"),
    (hf_io, "_write_json"),
    (out_dir, "_exchange"),
]


@contextmanager
def killed_at(n: int, monkeypatch):
    """Raises Killed at the n-th (0-based) call of CALLS, counted together."""
    count = [0]

    def wrap(fn):
        def call(*a, **k):
            if count[0] == n:
                raise Killed
            count[0] += 1
            return fn(*a, **k)

        return call

    with monkeypatch.context() as m:
        for owner, name in CALLS:
            m.setattr(owner, name, wrap(getattr(owner, name)))
        yield


def test_a_kill_anywhere_leaves_the_old_or_the_new_export(tmp_path, monkeypatch):
    """Old: three shards with an index, plus a tokenizer file the user copied in. New: one
    file and a generation_config.json. After a kill at each call in turn, OUT_DIR is the old
    export or the new one byte for byte; the next export completes and leaves nothing hidden."""
    out = tmp_path / "exported"
    export(out, tensors(0), max_bytes=1200)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    old = snapshot(out)
    assert hf_io.INDEX in old and len([n for n in old if n.startswith("model-")]) == 3
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine)

    gen = {"generation_config.json": {"eos_token_id": 2}}
    written = export(out, tensors(1), max_bytes=2**30, extra=gen)
    new = snapshot(out)
    assert sorted(written) == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(new) == sorted([*written, "tokenizer.json"])  # no stale index or shard
    assert new["tokenizer.json"] == old["tokenizer.json"]
    assert hidden(out) == []

    outcomes = []
    for n in range(100):
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        try:
            with killed_at(n, monkeypatch):
                export(out, tensors(1), max_bytes=2**30, extra=gen)
        except Killed:
            now = snapshot(out)
            assert now in (old, new), f"kill before call {n}: OUT_DIR is {sorted(now)}"
            outcomes.append("new" if now == new else "old")
            export(out, tensors(1), max_bytes=2**30, extra=gen)  # the next export
            assert snapshot(out) == new and hidden(out) == [], n
            continue
        break  # no kill: the export ran to its end
    print(
        f"\n{len(outcomes)} kill points: {outcomes.count('old')} old, {outcomes.count('new')} new"
    )
    assert len(outcomes) >= 10 and "old" in outcomes and "new" in outcomes
    export(out, tensors(1), max_bytes=2**30)  # without one: the old one is not carried
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_stale_siblings_of_ours_are_removed_and_no_other(tmp_path):
    out = tmp_path / "exported"
    (tmp_path / ".exported.tmp-abc123").mkdir()  # a killed export's
    (tmp_path / ".exported.tmp-abc123_old").mkdir()  # a killed swap's
    (tmp_path / ".other.tmp-abc123").mkdir()  # another directory's
    (tmp_path / ".exported.tmp-x.keep").mkdir()  # not a name we make
    export(out, tensors(0), max_bytes=2**30)
    assert sorted(os.listdir(tmp_path)) == [".exported.tmp-x.keep", ".other.tmp-abc123", "exported"]
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: (d / "notes.txt").write_text("mine"), "holds other files (notes.txt)"),
        (lambda d: (d / "checkpoints").mkdir(), "holds subdirectories (checkpoints)"),
        (lambda d: (d / "config.json").write_text('{"model": {}}'), "holds other files"),
    ],
    ids=["other files", "a run dir", "a config.json that is not HF's"],
)
def test_a_directory_that_is_not_an_export_is_refused(tmp_path, make, needle):
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    before = snapshot(out) if not (out / "checkpoints").exists() else None
    with pytest.raises(InteropError, match=re.escape(needle)) as e:
        export(out, tensors(0), max_bytes=2**30)
    assert "\n" not in str(e.value) and "pass a new or empty directory" in str(e.value)
    if before is not None:
        assert snapshot(out) == before
    assert hidden(out) == []
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InteropError, match="is a file"):
        export(a_file, tensors(0), max_bytes=2**30)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(InteropError, match="is a symbolic link"):
        export(tmp_path / "link", tensors(0), max_bytes=2**30)
