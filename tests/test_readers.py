"""`eval` and `export-hf` only read (`trn_accum.checkpoint.reader`): beside a trainer that writes
a checkpoint every step (and deletes old ones), on a run dir they cannot write, and without
orbax's late noise when a restore fails."""

import asyncio
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import NO_JAX_CACHE, subprocess_env
from orbax.checkpoint._src import asyncio_utils

from trn_accum.checkpoint import reader as ckpt_reader
from trn_accum.checkpoint.checkpointer import CheckpointError
from trn_accum.interop import convert, hf_io

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
STEPS = 24  # the readers (eval, then export-hf) end near step 9 (2 busy cores)
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# eval then export-hf, through the CLI's main, in one process started beside the trainer: it
# imports JAX while the trainer compiles, then waits for the first committed checkpoint
READER = """
import sys, time
from trn_accum.cli import main
from trn_accum.interop import convert, evaluate
from trn_accum.checkpoint.reader import committed_steps
run, tokens, out = sys.argv[1:]
deadline = time.monotonic() + 240
while not committed_steps(run + "/checkpoints") and time.monotonic() < deadline:
    time.sleep(0.05)
code = main(["eval", "--run-dir", run, "--tokens", tokens, "--json"])
sys.exit(code or main(["export-hf", run, out, "--dtype", "float32"]))
"""


def start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def live():
    """fuji-tiny trained STEPS steps with a checkpoint every step (keep 2: the trainer deletes
    old steps as it goes); once the first is committed, `eval` and `export-hf` read the run:
    as user nobody where we are root (the trainer's files are root's: nothing there can be
    written), else as ourselves. World-readable, so not under pytest's private tmp dirs."""
    base = Path(tempfile.mkdtemp(prefix="trn-readers-"))
    base.chmod(0o755)
    np.save(base / "tok.npy", np.random.default_rng(0).integers(0, 512, (4, 33)))
    (base / "exports").mkdir()
    (base / "exports").chmod(0o777)
    run = base / "run"
    sets = [f"trainer.steps={STEPS}", "checkpoint.every=1", "trainer.eval_every=0"]
    args = ["train", "--config", TINY, "--run-dir", run, *[a for s in sets for a in ("--set", s)]]
    trainer = start([sys.executable, "-m", "trn_accum.cli", *map(str, args)], subprocess_env())
    as_nobody = os.geteuid() == 0
    reader = start(
        [*(NOBODY if as_nobody else []), sys.executable, "-c", READER]
        + [str(run), str(base / "tok.npy"), str(base / "exports" / "hf")],
        subprocess_env(**NO_JAX_CACHE, HOME=str(base / "exports")),
    )
    try:
        read = reader.communicate(timeout=300)
        trainer_ran_on = trainer.poll() is None
        metrics = run / "metrics.jsonl"
        at_step = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        out, err = trainer.communicate(timeout=300)
    finally:
        for p in (reader, trainer):
            if p.poll() is None:
                p.kill()
    yield {
        "base": base,
        "run": run,
        "reader": (reader.returncode, *read),
        "as_nobody": as_nobody,
        "trainer": (trainer.returncode, out, err),
        "trainer_ran_on": trainer_ran_on,
        "at_step": at_step,
    }
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.xdist_group("readers_live")
def test_readers_beside_a_live_trainer(live):
    code, out, err = live["trainer"]
    read_code, read_out, read_err = live["reader"]
    assert code == 0, err[-3000:]
    assert f"done: step {STEPS}" in out, out[-2000:]
    assert read_code == 0, read_err[-3000:]
    assert live["trainer_ran_on"], "the trainer ended before the readers: raise STEPS"
    got = json.loads(read_out.strip().splitlines()[-2])  # eval's line; export's follows
    assert got["tokens"] == 4 * 32 and np.isfinite(got["loss"])
    exported = live["base"] / "exports" / "hf"
    shapes = hf_io.tensor_headers(hf_io.tensor_files(str(exported)))
    assert len(shapes) == 2 + 2 * 9 and all(dtype == "F32" for dtype, _ in shapes.values())
    committed = ckpt_reader.committed_steps(str(live["run"] / "checkpoints"))
    assert committed == [STEPS - 1, STEPS]  # keep 2: rotation ran beside the readers
    who = "nobody" if live["as_nobody"] else "ourselves"
    print(f"\nreaders as {who}: {got}, done at trainer step {live['at_step']} of {STEPS}")


@pytest.mark.xdist_group("readers_live")
def test_read_only_run_dir_is_read(live):
    """A run dir nobody may write, with a save in progress left in it, reads; the leftover
    stays. As root: user nobody (above) could write nothing there. Here the run dir is made
    read-only as well, which binds where we are not root."""
    run = live["run"]
    leftover = run / "checkpoints" / f"{STEPS + 1}.orbax-checkpoint-tmp"
    leftover.mkdir()
    (leftover / "partial").write_text("x")
    mode = {p: p.stat().st_mode for p in [run, *run.rglob("*")]}
    for p in mode:
        p.chmod(mode[p] & ~0o222)
    try:
        cfg, _, params, step = convert.restore_params(str(run))
    finally:
        for p, m in mode.items():
            p.chmod(m)
    assert step == STEPS and cfg.trainer.steps == STEPS
    assert set(params) >= {"embed", "layers", "final_norm"}
    assert (leftover / "partial").read_text() == "x"
    if live["as_nobody"]:
        assert live["reader"][0] == 0


def test_a_step_deleted_while_read_is_read_again(tmp_path):
    """keep-last-K deletes the step being read: the reader lists again and reads the newest."""
    for name in ("3", "4", "5.orbax-checkpoint-tmp"):
        (tmp_path / name).mkdir()
    seen = []

    def read(step_dir):
        seen.append(os.path.basename(step_dir))
        if len(seen) == 1:  # rotated away under us, as Checkpointer._rotate does
            os.rename(step_dir, step_dir + ".orbax-checkpoint-tmp-deleted")
            raise FileNotFoundError(step_dir)
        return "ok"

    assert ckpt_reader.read_newest(str(tmp_path), read, "fix") == (3, "ok")
    assert seen == ["4", "3"]

    def damaged(step_dir):
        raise ValueError("bad bytes")

    with pytest.raises(CheckpointError, match=r"checkpoint .*/3 cannot be read \(ValueError"):
        ckpt_reader.read_newest(str(tmp_path), damaged, "fix")
    assert sorted(os.listdir(tmp_path)) == [
        "3",
        "4.orbax-checkpoint-tmp-deleted",
        "5.orbax-checkpoint-tmp",
    ]


async def _one_read_fails():
    """What orbax's restore does: reads gathered as tasks; one fails while others wait on I/O,
    and each wraps whatever reaches it (its cancellation, or its closing) in a new error."""

    async def slow():
        try:
            await asyncio.sleep(30)
        except BaseException as e:
            raise RuntimeError("read interrupted") from e

    async def fails():
        raise ValueError("damaged")

    await asyncio.gather(slow(), slow(), fails())


@pytest.mark.parametrize("finishing", [False, True])
def test_a_failed_restore_leaves_no_pending_reads(monkeypatch, finishing):
    """orbax's run_sync closes its loop with the other reads pending; collected later, each
    prints `Exception ignored in: <coroutine ...>`. Under `finishing_loops` they end first."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with ckpt_reader.finishing_loops() if finishing else contextlib.nullcontext():
        with pytest.raises(ValueError, match="damaged"):
            asyncio_utils.run_sync(_one_read_fails())
    gc.collect()  # the closed loop and its tasks are garbage now
    coroutines = [u for u in ignored if "coroutine" in repr(u.object)]
    assert len(coroutines) == (0 if finishing else 2)  # 2: the failure the test can see
