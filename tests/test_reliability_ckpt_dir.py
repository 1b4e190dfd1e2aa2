"""Issue 38, fault 6: at start the Checkpointer removes the leftovers of killed saves
(`<step>.orbax-checkpoint-tmp*`) and of killed keep-last-K deletions
(`<step>.orbax-checkpoint-tmp-deleted`), logs what it freed, and never touches a committed
step. Real orbax saves; the leftovers are what a kill in those windows leaves on disk."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from trn_accum.checkpoint import leftovers as ckpt_dir
from trn_accum.checkpoint.checkpointer import Checkpointer, abstract_state


def _state(value: float) -> dict:
    w = np.random.default_rng(int(value)).standard_normal((256, 256), np.float32)
    return {"w": jnp.asarray(w), "step": jnp.asarray(int(value))}


def _digest(path) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(d, f), path): hashlib.sha256(
            open(os.path.join(d, f), "rb").read()
        ).hexdigest()
        for d, _, fs in os.walk(path)
        for f in fs
    }


def test_leftovers_are_removed_at_start_and_committed_steps_kept(tmp_path, caplog):
    with Checkpointer(str(tmp_path), keep=5, async_save=False) as ck:
        for step in (1, 2):
            ck.save(step, _state(step), force=True)
    committed = {s: _digest(tmp_path / s) for s in ("1", "2")}
    # a keep-last-K deletion killed between its rename and its rmtree; a save of step 3 killed
    # before its commit (no marker), under both of orbax's temporary names
    killed = [
        tmp_path / f"1{ckpt_dir.DELETED_SUFFIX}",
        tmp_path / f"3{ckpt_dir.TMP_SUFFIX}",
        tmp_path / f"4{ckpt_dir.TMP_SUFFIX}-1733456789",
    ]
    for path in killed:
        shutil.copytree(tmp_path / "2", path)
    os.remove(killed[1] / "commit_success.txt")
    (tmp_path / "notes.orbax-checkpoint-tmp").mkdir()  # not a step's name: not ours
    size = ckpt_dir.tree_bytes(tmp_path / "2")
    assert size > 256 * 256 * 4 * 0.9  # the state's bytes (random: they do not compress)

    with caplog.at_level(logging.WARNING, logger="trn_accum.checkpoint.checkpointer"):
        with Checkpointer(str(tmp_path)) as ck:
            assert ck.latest_step() == 2
            restored, meta = ck.restore(abstract_state(jax.device_get(_state(0))))
    np.testing.assert_array_equal(restored["w"], _state(2)["w"])
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "notes.orbax-checkpoint-tmp"]
    assert {s: _digest(tmp_path / s) for s in ("1", "2")} == committed  # untouched
    freed = [r.getMessage() for r in caplog.records if "freed" in r.getMessage()]
    assert len(freed) == 3, freed
    for path, line in zip(killed, freed, strict=True):
        assert str(path) in line and f"freed {size / 2**20:.1f} MiB" in line, line
    assert not any("uncommitted" in r.getMessage() for r in caplog.records)


def test_leftovers_lists_only_temporary_step_names(tmp_path):
    for name in ("7", "7.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-deleted", "x.tmp", "9x"):
        (tmp_path / name).mkdir()
    (tmp_path / "9.orbax-checkpoint-tmp").write_text("a file, not a directory")
    assert ckpt_dir.leftovers(str(tmp_path)) == [
        str(tmp_path / "7.orbax-checkpoint-tmp"),
        str(tmp_path / "8.orbax-checkpoint-tmp-deleted"),
    ]
