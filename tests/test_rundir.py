"""The run dir's owner claim and the trajectory record (`trn_accum.checkpoint.rundir`, `.drift`):
create/heartbeat/release, a live owner refused in one line, a killed owner taken over, another
host's fresh and stale claims, a garbage claim file, the same job waiting for its previous
start, racing claimants (exactly one wins), a lost claim noticed, the job's ranks (one
broadcast, a run dir that is not shared), and config drift listed, allowed and recorded."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from multiprocess import cpu_env, run_processes

from trn_accum.checkpoint import liveness as claim_liveness
from trn_accum.checkpoint import rundir
from trn_accum.checkpoint.rundir import Claim, RunDirError
from trn_accum.config import drift
from trn_accum.config.load import Config, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "fuji-tiny.toml"


def _quiet(_):
    pass


def _foreign(tmp_path, *, heartbeat_age=0.0, job=None, host="other-host"):
    """A claim file written by a trainer on another machine."""
    now = time.time()
    claim = {
        "format": rundir.CLAIM_FORMAT,
        "token": "f" * 16,
        "host": host,
        "boot_id": "another-kernel",
        "pidns": "pid:[1]",
        "pid": 4242,
        "start_ticks": 1,
        "job": job,
        "since": now - 3600,
        "heartbeat": now - heartbeat_age,
    }
    path = tmp_path / rundir.CLAIM_FILE
    tmp = tmp_path / f".{rundir.CLAIM_FILE}.test-tmp"
    tmp.write_text(json.dumps(claim))
    os.replace(tmp, path)  # atomically, as a trainer refreshes its claim (a reader never sees
    return path  # a half-written file; the garbage-claim cases are tested on their own)


def test_claim_created_refreshed_and_released(tmp_path):
    with Claim(tmp_path, heartbeat_every=0.05, say=_quiet).acquire() as c:
        rec = json.loads((tmp_path / rundir.CLAIM_FILE).read_text())
        assert rec["token"] == c.token and rec["pid"] == os.getpid()
        assert rec["host"] and rec["since"] <= rec["heartbeat"]
        first = rec["heartbeat"]
        deadline = time.time() + 10
        while json.loads((tmp_path / rundir.CLAIM_FILE).read_text())["heartbeat"] == first:
            assert time.time() < deadline, "heartbeat never refreshed"
            time.sleep(0.02)
        assert c.lost is None
    assert sorted(os.listdir(tmp_path)) == []  # released; no temporary file left


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from trn_accum.checkpoint.rundir import Claim
    c = Claim(sys.argv[1], say=lambda _: None).acquire()
    print("READY", flush=True)
    time.sleep(600)
    """
)


def test_live_owner_refused_then_killed_owner_taken_over(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        env=cpu_env(1),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "READY"
        with pytest.raises(RunDirError) as e:
            Claim(tmp_path, say=_quiet).acquire()
        msg = str(e.value)
        assert "\n" not in msg and "in use by another trainer" in msg
        assert f"pid {holder.pid}" in msg and "job none" in msg and "since 20" in msg
        assert "--run-dir" in msg and "120 s" in msg  # the fix and the stale bound
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
        holder.wait()
    said = []
    with Claim(tmp_path, say=said.append).acquire() as c:  # the pid is gone: no waiting
        assert json.loads((tmp_path / rundir.CLAIM_FILE).read_text())["token"] == c.token
    assert said and "took over" in said[0] and f"pid {holder.pid} on this host is gone" in said[0]


def test_reused_pid_on_this_host_counts_as_gone(tmp_path):
    me = claim_liveness.machine()
    claim = {"format": rundir.CLAIM_FORMAT, "token": "a" * 16, **me, "pid": os.getpid()}
    claim.update(start_ticks=-5, heartbeat=time.time(), since=time.time())  # not our start
    (tmp_path / rundir.CLAIM_FILE).write_text(json.dumps(claim))
    with Claim(tmp_path, say=_quiet).acquire():
        pass


def test_other_host_fresh_refused_stale_taken_over(tmp_path):
    _foreign(tmp_path, heartbeat_age=5)
    with pytest.raises(RunDirError, match="host other-host, pid 4242, job none"):
        Claim(tmp_path, say=_quiet).acquire()
    _foreign(tmp_path, heartbeat_age=1000)
    said = []
    with Claim(tmp_path, say=said.append).acquire():
        assert "heartbeat is 1000 s old (stale after 120 s)" in said[0]


def test_heartbeat_from_the_future_beyond_the_skew_bound_is_stale(tmp_path):
    """Clock skew within MAX_SKEW_S keeps a claim alive; a heartbeat far in the future (a clock
    far off, a torn write: the issue's -999999998203701504 s) is taken over, not refused forever."""
    _foreign(tmp_path, heartbeat_age=-(claim_liveness.MAX_SKEW_S - 5))
    with pytest.raises(RunDirError, match="host other-host"):
        Claim(tmp_path, say=_quiet).acquire()
    _foreign(tmp_path, heartbeat_age=-1e18)
    said = []
    with Claim(tmp_path, say=said.append).acquire():
        assert "in the future (beyond the 60 s clock-skew bound)" in said[0], said
    path = tmp_path / rundir.CLAIM_FILE
    path.write_bytes(b"torn")
    future = time.time() + 1e6
    os.utime(path, (future, future))
    with Claim(tmp_path, say=said.append).acquire():
        assert "unreadable claim file" in said[-1] and "in the future" in said[-1], said


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00torn", b'{"format": "trn_accum.cl', b"[1, 2]"])
def test_garbage_claim_is_refused_while_fresh_and_taken_over_when_old(tmp_path, garbage):
    path = tmp_path / rundir.CLAIM_FILE
    path.write_bytes(garbage)
    with pytest.raises(RunDirError) as e:
        Claim(tmp_path, say=_quiet).acquire()
    assert "unreadable claim file" in str(e.value) and "\n" not in str(e.value)
    old = time.time() - 1000
    os.utime(path, (old, old))
    with Claim(tmp_path, say=_quiet).acquire() as c:
        assert json.loads(path.read_text())["token"] == c.token


def test_same_job_waits_for_its_previous_start(tmp_path, monkeypatch):
    env = {"TRN_ACCUM_JOB_ID": "slurm:77"}
    path = _foreign(tmp_path, job="slurm:77")
    threading.Timer(1.0, path.unlink).start()  # the previous start exits and releases
    said = []
    t0 = time.time()
    with Claim(tmp_path, env=env, say=said.append).acquire():
        assert time.time() - t0 >= 1.0
    assert "waiting up to" in said[0] and "previous start of job slurm:77" in said[0]
    # A previous start that keeps beating past the bound: refused after waiting for it.
    stop = threading.Event()

    def keep_beating():
        while not stop.wait(0.05):
            _foreign(tmp_path, job="slurm:77")

    _foreign(tmp_path, job="slurm:77")
    beater = threading.Thread(target=keep_beating)
    beater.start()
    monkeypatch.setattr(rundir, "_POLL_S", 0.1)
    t0 = time.time()
    try:
        with pytest.raises(RunDirError, match="job slurm:77"):
            Claim(tmp_path, env=env, stale_after=1.0, heartbeat_every=0.2, say=_quiet).acquire()
    finally:
        stop.set()
        beater.join()
    assert 1.2 <= time.time() - t0 < 10


_RACER = textwrap.dedent(
    """
    import sys, time
    from trn_accum.checkpoint.rundir import Claim, RunDirError
    start = float(sys.argv[2])
    while time.time() < start:
        time.sleep(0.001)
    try:
        c = Claim(sys.argv[1], say=lambda _: None).acquire()
        print("WON", flush=True)
        time.sleep(3)
        c.release()
    except RunDirError:
        print("REFUSED", flush=True)
    """
)


def test_racing_claimants_exactly_one_wins(tmp_path):
    start = time.time() + 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(tmp_path), str(start)],
            env=cpu_env(1),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["REFUSED"] * 5 + ["WON"], outs
    assert not (tmp_path / rundir.CLAIM_FILE).exists()


def test_lost_claim_is_noticed_and_not_removed(tmp_path):
    c = Claim(tmp_path, heartbeat_every=3600, say=_quiet).acquire()
    path = _foreign(tmp_path)  # another trainer took over while this one was frozen
    c.beat()
    assert c.lost and "lost run dir" in c.lost and "other-host" in c.lost
    c.release()
    assert path.exists()  # not ours: left alone


def test_take_over_leaves_a_claim_that_changed_meanwhile(tmp_path):
    path = _foreign(tmp_path, heartbeat_age=1000)
    judged = path.read_bytes()
    _foreign(tmp_path, heartbeat_age=0)  # it beat between our read and our rename
    now = path.read_bytes()
    assert not Claim(tmp_path, say=_quiet)._take_over(judged)
    assert path.read_bytes() == now and sorted(os.listdir(tmp_path)) == [rundir.CLAIM_FILE]


def test_job_id_from_the_scheduler():
    assert claim_liveness.job_id({}) is None
    assert claim_liveness.job_id({"SLURM_JOB_ID": "12"}) == "slurm:12"
    k8s = {"JOB_COMPLETION_INDEX": "0", "TRN_ACCUM_JOB_NAME": "fuji"}
    assert claim_liveness.job_id(k8s) == "k8s:fuji"
    assert claim_liveness.job_id({"TRN_ACCUM_JOB_ID": "x", "SLURM_JOB_ID": "12"}) == "x"


_RANKS = textwrap.dedent(
    """
    import os, sys
    from trn_accum.cluster import distributed
    distributed.initialize()
    import jax
    from trn_accum.checkpoint import rundir
    shared, owned, base = sys.argv[1:4]
    rank = jax.process_index()
    c = rundir.claim_for_job(shared, say=lambda _: None)
    print("FIRST", "owner" if c is not None else "member", c.token if c else "", flush=True)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("first-seen")  # process 1 has seen the claim: release
    if c is not None:
        c.release()
    for name, run_dir, wait in (("SECOND", owned, 30), ("THIRD", f"{base}-{rank}", 1)):
        try:
            c = rundir.claim_for_job(run_dir, say=lambda _: None, wait_visible=wait)
            print(name, "ok", flush=True)
            if c is not None:
                c.release()
        except rundir.RunDirError as e:
            print(name, "error", e, flush=True)
    """
)


@pytest.mark.slow
def test_job_ranks_learn_the_outcome_from_process_0(tmp_path):
    """2 processes: process 0 claims and the other learns the outcome (one broadcast); a run
    dir owned by another trainer refuses both; a run dir that is not shared is named."""
    shared, owned = tmp_path / "shared", tmp_path / "owned"
    shared.mkdir()
    owned.mkdir()
    _foreign(owned)
    (tmp_path / "local-0").mkdir()
    (tmp_path / "local-1").mkdir()
    res = run_processes(
        [
            "-c",
            _RANKS,
            str(shared),
            str(owned),
            str(tmp_path / "local"),
        ],
        2,
        devices_per_process=1,
        timeout=180,
    )
    r0, r1 = res
    assert r0.tagged("FIRST").startswith("owner") and r1.tagged("FIRST") == "member"
    assert "in use by another trainer" in r0.tagged("SECOND") and "other-host" in r0.tagged(
        "SECOND"
    )
    assert "process 0 could not claim" in r1.tagged("SECOND")
    assert r0.tagged("THIRD") == "ok"
    assert "does not see" in r1.tagged("THIRD") and "shared by all nodes" in r1.tagged("THIRD")
    assert not (shared / rundir.CLAIM_FILE).exists()


# ---------------------------------------------------------------------------------------------
# Config drift

DEFAULTS = config_to_dict(Config())


def test_trajectory_changes_ignore_free_keys_and_list_the_rest():
    old = config_to_dict(load_config(TINY))
    free = load_config(
        TINY,
        [
            "trainer.steps=999",
            "trainer.accum_steps=8",
            "trainer.loop=unroll",
            "trainer.reduce=once",
            "mesh.fsdp=4",
            "mesh.nodes=7",
            "checkpoint.every=3",
            "trainer.log_every=1",
            "trainer.eval_every=7",
            "model.remat=full",
            "data.eval_batches=9",
        ],
    )
    assert drift.trajectory_changes(old, config_to_dict(free), DEFAULTS) == {}
    new = load_config(TINY, ["data.seed=3", "trainer.seed=5", "optimizer.peak_lr=1e-3"])
    changes = drift.trajectory_changes(old, config_to_dict(new), DEFAULTS)
    assert changes == {
        "data.seed": (0, 3),
        "optimizer.peak_lr": (3e-3, 1e-3),
        "trainer.seed": (0, 5),
    }
    # A key missing from an old record is compared as its default.
    del old["trainer"]["seed"]
    assert "trainer.seed" in drift.trajectory_changes(old, config_to_dict(new), DEFAULTS)
    assert drift.trajectory_changes(old, config_to_dict(load_config(TINY)), DEFAULTS) == {}


def test_drift_message_and_allowed_keys(tmp_path):
    changes = {"data.seed": (0, 1), "data.global_batch": (32, 64)}
    with pytest.raises(drift.ConfigDriftError) as e:
        drift.check_drift(changes, set(), run_dir=str(tmp_path), step=8, record="checkpoint 8")
    msg = str(e.value)
    assert "\n" not in msg and "data.seed 0 -> 1" in msg and "data.global_batch 32 -> 64" in msg
    assert "--allow-config-change data.seed data.global_batch" in msg and "step 8" in msg
    allowed = drift.check_allowed_keys(["data"], DEFAULTS)
    assert {"data.seed", "data.global_batch"} <= allowed
    drift.check_drift(changes, allowed, run_dir=str(tmp_path), step=8, record="x")
    with pytest.raises(drift.ConfigDriftError, match="--allow-config-change data.sed"):
        drift.check_allowed_keys(["data.sed"], DEFAULTS)
    drift.log_changes(str(tmp_path), 8, changes)
    row = json.loads((tmp_path / drift.CHANGES_FILE).read_text())
    assert row["step"] == 8 and row["changes"]["data.seed"] == {"old": 0, "new": 1}


@pytest.mark.parametrize(
    "content", [None, b"\xff\xfe garbage", b'{"model": {"vocab', b"[1, 2, 3]", b'{"model": 3}']
)
def test_recorded_config_prefers_checkpoint_and_survives_a_garbage_config_json(tmp_path, content):
    cfg = config_to_dict(load_config(TINY))
    assert drift.recorded_config(str(tmp_path), {"config": cfg, "step": 4}) == (
        cfg,
        "checkpoint 4's metadata",
    )
    if content is not None:
        (tmp_path / drift.CONFIG_FILE).write_bytes(content)
    record, why = drift.recorded_config(str(tmp_path), {"step": 4})
    assert record is None and str(tmp_path / drift.CONFIG_FILE) in why
    (tmp_path / drift.CONFIG_FILE).write_text(json.dumps(cfg))
    assert drift.recorded_config(str(tmp_path), None)[0] == cfg
