"""Checkpoints: exact roundtrip, keep-last-K, commit markers, corruption, SIGKILL mid-save,
restore on another device count, preemption agreement across processes."""

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import xla_flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.checkpoint.checkpointer import Checkpointer, CheckpointError, abstract_state
from trn_accum.errors import EXIT_PREEMPTED
from trn_accum.train.preemption import Preemption

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))


def _state(step: int, mesh):
    """A train-state-like pytree: params, optax AdamW state, step, a PRNG key, a bf16 leaf."""
    k = jax.random.key(step)
    params = {
        "w": jax.random.normal(k, (16, 8), jnp.float32),
        "b": jnp.linspace(-1, 1, 8, dtype=jnp.float32) * step,
        "e": jax.random.normal(jax.random.fold_in(k, 1), (8, 4)).astype(jnp.bfloat16),
    }
    opt = optax.adamw(1e-3).init(params)
    specs = {"w": P("fsdp", None), "b": P(), "e": P(None, "data")}
    params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in params.items()}
    return {
        "params": params,
        "opt": opt,
        "step": jnp.int32(step),
        "skipped": jnp.int32(7),
        "rng": jax.random.key(100 + step),
    }


def _assert_bit_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _listing(root):
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def test_roundtrip_bit_exact_with_metadata(tmp_path):
    mesh = _mesh()
    state = _state(5, mesh)
    with Checkpointer(str(tmp_path), save_every=5) as ck:
        assert ck.latest_step() is None
        assert ck.save(5, state, metadata={"config": {"model": {"layers": 2}}, "note": "x"})
        ck.wait_until_finished()
        assert ck.save(5, state, force=True) is False  # already committed
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.latest_step() == 5
        restored, meta = ck.restore(abstract_state(state))
    _assert_bit_equal(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert meta == {"config": {"model": {"layers": 2}}, "note": "x", "step": 5}
    assert os.path.exists(tmp_path / "5" / "commit_success.txt")


def test_async_save_survives_deleting_the_source(tmp_path):
    """save() returns after copying to host: the trainer may donate the state right away."""
    mesh = _mesh()
    state = _state(1, mesh)
    expected = jax.tree.map(np.asarray, state["params"])
    with Checkpointer(str(tmp_path), async_save=True) as ck:
        ck.save(1, state, force=True)
        for leaf in jax.tree.leaves(state["params"]):
            leaf.delete()
        ck.wait_until_finished()
        restored, _ = ck.restore(abstract_state(_state(1, mesh)))
    for n, v in expected.items():
        assert np.asarray(restored["params"][n]).tobytes() == v.tobytes()


def test_keep_last_k_and_interval(tmp_path):
    mesh = _mesh()
    small = {"x": jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("fsdp")))}
    with Checkpointer(str(tmp_path), save_every=2, keep=2, async_save=False) as ck:
        saved = [s for s in range(10) if ck.save(s, {"x": small["x"] + s})]
        assert saved == [0, 2, 4, 6, 8]
        assert ck.committed_steps() == [6, 8]
        assert ck.save(9, {"x": small["x"] + 9}, force=True)
        assert ck.committed_steps() == [8, 9]
        restored, meta = ck.restore(abstract_state(small))
    assert meta["step"] == 9 and float(restored["x"][0]) == 9.0
    assert sorted(n for n in os.listdir(tmp_path) if n.isdigit()) == ["8", "9"]


@contextlib.contextmanager
def _undeletable(*paths):
    """`chattr +i` on each path for the block: not even root may rename or delete it."""
    from tmpfs import _unavailable

    if not shutil.which("chattr"):
        _unavailable("no chattr: cannot make a step directory undeletable")
    done = []
    try:
        for p in paths:
            r = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
            if r.returncode:
                _unavailable(f"`chattr +i` failed: {r.stderr.strip()}")
            done.append(p)
        yield
    finally:
        for p in done:
            subprocess.run(["chattr", "-i", str(p)], capture_output=True)


def test_rotation_never_deletes_the_new_commit(tmp_path, caplog):
    """keep=2, old steps 15 and 20 undeletable: saving 25 (async) commits it, the failed
    deletion of 15 is one warning naming the step and its path, no error, and 25 restores;
    saving 30 warns once about 20 (15 is not retried). Then, deletable again, keep=2 holds."""
    mesh = _mesh()
    small = {"x": jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("fsdp")))}
    with Checkpointer(str(tmp_path), keep=2, async_save=False) as ck:
        for s in (15, 20):
            assert ck.save(s, {"x": small["x"] + s}, force=True)
    caplog.set_level(logging.WARNING, logger="trn_accum.checkpoint.checkpointer")
    with _undeletable(tmp_path / "15", tmp_path / "20"):
        with Checkpointer(str(tmp_path), keep=2) as ck:
            assert ck.save(25, {"x": small["x"] + 25}, force=True)
            ck.wait_until_finished()  # commits 25, then rotation: raises nothing
            assert ck.background_failure() is None
            warned = [r.getMessage() for r in caplog.records if "could not be deleted" in r.message]
            assert len(warned) == 1 and "\n" not in warned[0], warned
            assert f"old checkpoint step 15 at {tmp_path / '15'} could not be deleted" in warned[0]
            assert ck.committed_steps() == [20, 25]
            restored, meta = ck.restore(abstract_state(small))
            assert meta["step"] == 25 and float(restored["x"][0]) == 25.0
            assert ck.save(30, {"x": small["x"] + 30}, force=True)
            ck.wait_until_finished()
            warned = [r.getMessage() for r in caplog.records if "could not be deleted" in r.message]
            assert len(warned) == 2 and "old checkpoint step 20 at" in warned[1], warned
            assert ck.committed_steps() == [25, 30]
        steps = sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit())
        assert steps == [15, 20, 25, 30], os.listdir(tmp_path)
    # deletable again: a new run deletes the old ones and keeps exactly 2 (async saves)
    with Checkpointer(str(tmp_path), keep=2) as ck:
        for s in (35, 40, 45):
            assert ck.save(s, {"x": small["x"] + s}, force=True)
            assert ck.background_failure() is None
        ck.wait_until_finished()
        assert ck.committed_steps() == [40, 45]
    assert sorted(os.listdir(tmp_path)) == ["40", "45"]
    with Checkpointer(str(tmp_path)) as ck:
        restored, meta = ck.restore(abstract_state(small))
    assert meta["step"] == 45 and float(restored["x"][0]) == 45.0


def test_killed_save_is_removed_and_the_previous_step_resumed(tmp_path, caplog):
    mesh = _mesh()
    with Checkpointer(str(tmp_path), async_save=False) as ck:
        ck.save(1, _state(1, mesh), force=True)
        ck.save(2, _state(2, mesh), force=True)
    # a save of step 3 killed before its commit: orbax's temporary directory, no marker
    tmp = tmp_path / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", tmp)
    os.remove(tmp / "commit_success.txt")
    before = [p for p in _listing(tmp_path) if not p.startswith(tmp.name)]
    with caplog.at_level(logging.WARNING, logger="trn_accum.checkpoint.checkpointer"):
        ck = Checkpointer(str(tmp_path))
        assert ck.latest_step() == 2
        restored, meta = ck.restore(abstract_state(_state(0, mesh)))
        ck.close()
    assert meta["step"] == 2
    _assert_bit_equal(restored, _state(2, mesh))
    freed = [r.getMessage() for r in caplog.records if "freed" in r.getMessage()]
    assert len(freed) == 1 and str(tmp) in freed[0]  # removed at start, said once
    assert ck.uncommitted() == []
    assert _listing(tmp_path) == before  # the committed steps untouched


# A failed tensorstore read can complete after orbax closed its event loop; Python then reports
# "Event loop is closed" as an unraisable exception (harmless, orbax/tensorstore internals).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["zero", "truncate"])
def test_corrupt_committed_checkpoint_is_an_error(tmp_path, damage):
    mesh = _mesh()
    with Checkpointer(str(tmp_path), async_save=False) as ck:
        ck.save(1, _state(1, mesh), force=True)
        ck.save(2, _state(2, mesh), force=True)
    data_files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(tmp_path / "2" / "state")
        for f in fs
        if os.path.basename(d) == "d"
    ]
    assert data_files
    for f in data_files:
        size = os.path.getsize(f)
        if damage == "zero":
            with open(f, "wb") as fh:
                fh.write(b"\0" * size)
        else:
            os.truncate(f, size // 3)
    before = _listing(tmp_path)
    ck = Checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError) as e:
        ck.restore(abstract_state(_state(0, mesh)))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "2") in msg
    assert _listing(tmp_path) == before  # nothing deleted
    restored, _ = ck.restore(abstract_state(_state(0, mesh)), step=1)  # the older one is fine
    _assert_bit_equal(restored, _state(1, mesh))
    ck.close()


def test_mismatched_target_and_missing_checkpoint_are_errors(tmp_path):
    mesh = _mesh()
    ck = Checkpointer(str(tmp_path), async_save=False)
    with pytest.raises(CheckpointError) as e:
        ck.restore(abstract_state(_state(0, mesh)))
    assert "no committed checkpoint" in str(e.value)
    ck.save(1, {"a": jnp.zeros(4)}, force=True)
    with pytest.raises(CheckpointError) as e:
        ck.restore(
            {
                "a": jax.ShapeDtypeStruct((4,), jnp.float32),
                "b": jax.ShapeDtypeStruct((2,), jnp.float32),
            }
        )
    assert "\n" not in str(e.value) and str(tmp_path / "1") in str(e.value)
    ck.close()


_MISMATCH = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from trn_accum.checkpoint.checkpointer import Checkpointer, CheckpointError
    state = {"params": {"embed": jnp.ones((512, 64)), "norm": jnp.ones((64,))},
             "step": jnp.int32(3)}
    with Checkpointer(sys.argv[1], async_save=False) as ck:
        ck.save(3, state, force=True)
    target = {"params": {"embed": jax.ShapeDtypeStruct((512, 128), jnp.float32),
                         "norm": jax.ShapeDtypeStruct((128,), jnp.float32)},
              "step": jax.ShapeDtypeStruct((), jnp.int32)}
    with Checkpointer(sys.argv[1]) as ck:
        try:
            ck.restore(target)
        except CheckpointError as e:
            print("ERROR", e, flush=True)
    """
)


def test_shape_mismatch_names_the_leaves_without_a_traceback(tmp_path):
    """A config whose shapes differ from the checkpoint's: one line naming the leaves, and no
    `Event loop is closed` traceback after it (no array read was started)."""
    r = subprocess.run(
        [sys.executable, "-c", _MISMATCH, str(tmp_path)],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR ")][0]
    assert str(tmp_path / "3") in line
    assert "params/embed (512, 64) (needs (512, 128))" in line and "params/norm (64,)" in line
    assert "another model config" in line and "move it aside" not in line
    assert "Traceback" not in r.stderr and "Event loop" not in r.stderr, r.stderr


def test_background_save_failure_on_a_full_disk(tmp_path):
    """A real full filesystem (a 1.5 MB tmpfs): the background save of step 2 fails; the
    non-blocking check reports it once (EXIT_SAVE_FAILED, the path, the cause), removes the
    partial step directory, and step 1 stays restorable."""
    from tmpfs import small_tmpfs

    from trn_accum.errors import EXIT_SAVE_FAILED

    def state(seed):  # ~1 MiB of incompressible float32
        return {"w": jax.random.normal(jax.random.key(seed), (256, 1024), jnp.float32)}

    with small_tmpfs(tmp_path / "mnt", 1_500_000) as mnt:
        ck = Checkpointer(str(mnt / "ck"), keep=1)
        assert ck.save(1, state(1), force=True)
        ck.wait_until_finished()
        assert ck.background_failure() is None
        assert ck.save(2, state(2), force=True)  # starts; its writes fail in the background
        deadline = time.time() + 60
        while (err := ck.background_failure()) is None:
            assert time.time() < deadline, "the failed save was never reported"
            time.sleep(0.01)
        msg = str(err)
        assert err.exit_code == EXIT_SAVE_FAILED and "\n" not in msg
        assert f"checkpoint {mnt / 'ck' / '2'} could not be written" in msg
        assert "No space left on device" in msg and f"{mnt / 'ck' / '1'} is intact" in msg
        assert ck.background_failure() is None  # reported once
        ck.close()
        assert sorted(os.listdir(mnt / "ck")) == ["1"]  # no partial step directory left
        with Checkpointer(str(mnt / "ck")) as again:
            restored, _ = again.restore(abstract_state(state(1)))
        assert np.asarray(restored["w"]).tobytes() == np.asarray(state(1)["w"]).tobytes()


def test_unwritable_directory_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError) as e:
        Checkpointer(str(blocker / "ckpt"))
    assert str(blocker / "ckpt") in str(e.value) and "\n" not in str(e.value)


_SAVER = textwrap.dedent(
    """
    import sys, time, asyncio
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from orbax.checkpoint._src.path import atomicity
    from trn_accum.checkpoint.checkpointer import Checkpointer

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    sh = NamedSharding(mesh, P("fsdp"))
    def state(step):  # ~24 MiB
        return {"w": jax.device_put(jnp.full((1024, 2048), step, jnp.float32), sh),
                "v": jax.device_put(jnp.full((1024, 1024), -step, jnp.float32), sh),
                "step": jnp.int32(step)}
    ck = Checkpointer(sys.argv[1], async_save=True)
    ck.save(1, state(1), force=True)
    ck.wait_until_finished()
    async def never(self):  # a commit that never comes: the kill lands mid-save
        await asyncio.sleep(1000)
    atomicity.AtomicRenameTemporaryPath.finalize = never
    print("SAVING", flush=True)
    ck.save(2, state(2), force=True)
    ck.wait_until_finished()
    print("UNREACHABLE", flush=True)
    """
)


def test_sigkill_during_save_resumes_from_previous(tmp_path, caplog):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)],
        env=_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        tmp = tmp_path / "2.orbax-checkpoint-tmp"
        deadline = time.time() + 60
        while not tmp.exists() and time.time() < deadline:
            time.sleep(0.005)
        assert tmp.exists()
        proc.send_signal(signal.SIGKILL)  # as soon as the save has begun writing
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    mesh = _mesh()
    target = {
        "w": jax.ShapeDtypeStruct((1024, 2048), jnp.float32, sharding=NamedSharding(mesh, P())),
        "v": jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P())),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    with caplog.at_level(logging.WARNING, logger="trn_accum.checkpoint.checkpointer"):
        ck = Checkpointer(str(tmp_path))
        restored, meta = ck.restore(target)
        ck.close()
    assert meta["step"] == 1 and int(restored["step"]) == 1
    assert np.all(np.asarray(restored["w"]) == 1) and np.all(np.asarray(restored["v"]) == -1)
    assert any(str(tmp_path / "2.orbax-checkpoint-tmp") in r.getMessage() for r in caplog.records)


_RESTORE_4 = textwrap.dedent(
    """
    import sys, json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from trn_accum.checkpoint.checkpointer import Checkpointer
    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "model"))
    target = {
        "w": jax.ShapeDtypeStruct(
            (16, 8), jnp.float32, sharding=NamedSharding(mesh, P("model", "fsdp"))
        ),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }
    state, meta = Checkpointer(sys.argv[1]).restore(target)
    w = state["w"]
    assert w.sharding == target["w"].sharding and len(w.addressable_shards) == 4
    assert w.addressable_shards[0].data.shape == (8, 4)
    print("RESULT", json.dumps({"w": np.asarray(w).tolist(), "b": np.asarray(state["b"]).tolist(),
                                "step": int(state["step"]), "meta": meta}), flush=True)
    """
)


def test_restore_8_devices_onto_4(tmp_path):
    mesh = _mesh()
    w = np.arange(128, dtype=np.float32).reshape(16, 8) / 7
    b = np.linspace(-3, 3, 8, dtype=np.float32)
    state = {
        "w": jax.device_put(w, NamedSharding(mesh, P(("data", "fsdp"), None))),
        "b": jax.device_put(b, NamedSharding(mesh, P("fsdp"))),
        "step": jnp.int32(12),
    }
    assert len(state["w"].sharding.device_set) == 8
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(12, state, metadata={"devices": 8}, force=True)
    out = subprocess.run(
        [sys.executable, "-c", _RESTORE_4, str(tmp_path)],
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][0][7:])
    assert np.array_equal(np.asarray(res["w"], np.float32), w)
    assert np.array_equal(np.asarray(res["b"], np.float32), b)
    assert res["step"] == 12 and res["meta"] == {"devices": 8, "step": 12}


# ---------------------------------------------------------------------- preemption


def test_preemption_flag_single_process():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as pre:
        assert signal.getsignal(signal.SIGTERM) != before
        assert not pre.should_stop(0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the Python-level handler runs at the next bytecode boundary
        assert pre.requested and pre.received == signal.SIGTERM
        assert pre.should_stop(1) and pre.should_stop(2)
    assert signal.getsignal(signal.SIGTERM) == before
    with Preemption(signals=(signal.SIGUSR1,)) as pre:
        assert not pre.should_stop(0, save_failed=False, claim_lost=False)
        assert pre.should_stop(1, save_failed=True, claim_lost=False)
        assert pre.problems == {"save_failed"} and not pre.preempted
        assert not pre.should_stop(2, save_failed=False) and pre.problems == set()
        pre.request()
        assert pre.should_stop(3) and pre.preempted


_TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    pid, nproc, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    signal_at = int(sys.argv[5])  # step at which process 1 signals itself; -1: wait for parent
    if nproc > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    from trn_accum.errors import EXIT_PREEMPTED
    from trn_accum.checkpoint.checkpointer import Checkpointer
    from trn_accum.train.preemption import Preemption
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.make_array_from_callback((16,), sh, lambda idx: np.zeros(16, np.float32)[idx])
    step_fn = jax.jit(lambda x: x + 1.0, out_shardings=sh)
    ck = Checkpointer(root, save_every=100)
    with Preemption() as pre:
        for step in range(1, 1000):
            x = step_fn(x)
            if signal_at == step and pid == nproc - 1:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            if signal_at < 0:
                print("STEP", step, flush=True)
                time.sleep(0.05)
            if pre.should_stop(step):
                ck.save(step, {"x": x}, metadata={"why": "preempted"}, force=True)
                ck.close()
                print("STOP", step, flush=True)
                if nproc > 1:
                    jax.distributed.shutdown()
                sys.exit(EXIT_PREEMPTED)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restore_x(root):
    mesh = _mesh()
    target = {"x": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    with Checkpointer(str(root)) as ck:
        step = ck.latest_step()
        state, meta = ck.restore(target)
    return step, np.asarray(state["x"]), meta


def test_preemption_sigterm_from_outside_saves_and_exits_75(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, "0", "1", "0", str(tmp_path), "-1"],
        env=_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while True:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
            if line.startswith("STEP 3"):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stop = int([ln for ln in out.splitlines() if ln.startswith("STOP")][0].split()[1])
    assert stop >= 3
    step, x, meta = _restore_x(tmp_path)
    assert step == stop and np.all(x == stop) and meta == {"why": "preempted", "step": stop}


def test_preemption_agreement_two_processes_then_restore_on_one(tmp_path):
    """Only process 1 is signalled (at step 3); both stop at step 3, save together, exit 75."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TRAINER, str(i), "2", port, str(tmp_path), "3"],
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        finally:
            p.kill()
        assert p.returncode == EXIT_PREEMPTED, err[-3000:]
        outs.append(out)
    assert [o.split("STOP")[1].split()[0] for o in outs] == ["3", "3"]
    step, x, meta = _restore_x(tmp_path)  # saved by 2 processes x 4 devices, read by 1 x 8
    assert step == 3 and np.all(x == 3) and meta["why"] == "preempted"
