"""neuron-check rows only a node can prove, their logic on CPU: the root address row (resolve,
bind test, reservation) and the kernel-pair row's choice of shapes."""

from __future__ import annotations

import socket

import pytest

from trn_accum.config.load import load_config
from trn_accum.plan import node_rows
from trn_accum.plan.node_rows import FAIL, PASS, PairShape, kernel_pair_plan


def slurm(ntasks: int, procid: int, nodes: str = "trn2-[001-002]") -> dict:
    return {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "0",
    }


def dns(table: dict):
    def resolve(host):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


def free(_port):
    return None


# ----------------------------------------------------------------------------- root


def test_root_row_passes_when_resolved_free_and_reserved():
    status, detail = node_rows.row_root(
        slurm(2, 0), on_neuron=True, resolve=dns({"trn2-001": "10.0.0.1"}), bind=free,
        read=lambda path: "8080,40000-42000\n",
    )  # fmt: skip
    assert status == PASS, detail
    assert "trn2-001:41000 -> 10.0.0.1:41000" in detail
    assert "port 41000 free here (bind test)" in detail and "reserved" in detail


def test_root_row_fails_on_neuron_when_not_reserved_and_names_the_fix():
    status, detail = node_rows.row_root(
        {}, on_neuron=True, bind=free, read=lambda path: "8080\n"
    )  # one process: 127.0.0.1
    assert status == FAIL
    assert "port 41000 not in net.ipv4.ip_local_reserved_ports (8080)" in detail
    assert "sysctl -w net.ipv4.ip_local_reserved_ports=8080,41000" in detail
    # off Neuron the same finding is reported, not failed
    status, detail = node_rows.row_root({}, on_neuron=False, bind=free, read=lambda p: "")
    assert status == PASS and "reported only" in detail and "reserved_ports=41000 " in detail


def test_root_row_unresolvable_host_fails_naming_it():
    status, detail = node_rows.row_root(
        slurm(2, 1, "nowhere-[1-2]"), on_neuron=True, resolve=dns({}), bind=free,
        read=lambda p: "41000",
    )  # fmt: skip
    assert status == FAIL and "'nowhere-1'" in detail and "\n" not in detail


def test_root_row_binds_only_on_the_roots_host():
    calls = []

    def bind(port):
        calls.append(port)
        return None

    env = slurm(2, 1)  # rank 1: not the root
    status, detail = node_rows.row_root(
        env, on_neuron=True, resolve=dns({"trn2-001": "10.0.0.1"}), bind=bind,
        read=lambda p: "41000",
    )  # fmt: skip
    assert status == PASS and calls == [] and "bind not tested" in detail
    node_rows.row_root(
        slurm(2, 0), on_neuron=True, resolve=dns({"trn2-001": "10.0.0.1"}), bind=bind,
        read=lambda p: "41000",
    )  # fmt: skip
    assert calls == [41000]


def test_root_row_real_bind_test_sees_a_held_port():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {"TRN_ACCUM_NEURON_ROOT_PORT": str(port)}
        status, detail = node_rows.row_root(env, on_neuron=True, read=lambda p: str(port))
        assert status == FAIL and f"port {port} cannot be bound" in detail
        assert "TRN_ACCUM_NEURON_ROOT_PORT" in detail
    status, detail = node_rows.row_root(env, on_neuron=True, read=lambda p: str(port))
    assert status == PASS and f"port {port} free here" in detail  # released: free again


def test_root_row_uses_a_preset_address():
    env = {**slurm(2, 0), "NEURON_RT_ROOT_COMM_ID": "10.9.8.7:5000"}
    status, detail = node_rows.row_root(env, on_neuron=True, bind=free, read=lambda p: "5000")
    assert status == PASS and "10.9.8.7:5000 -> 10.9.8.7:5000" in detail


def test_root_row_unreadable_reservation_is_unknown_not_failed():
    status, detail = node_rows.row_root({}, on_neuron=True, bind=free, read=lambda p: None)
    assert status == PASS and "reservation unknown" in detail


# ----------------------------------------------------------------------------- kernel pair


def plan(**kw):
    args = {"seq": 8192, "heads": 24, "kv_heads": 8, "head_dim": 128, "model_axis": 4}
    return kernel_pair_plan(**{**args, **kw})


def test_kernel_pair_plan_job_shape_per_device():
    (job,) = plan(batch=2, lnc=2)  # 24/4 = 6 heads, 8/4 = 2 KV: B*KV = 4, never odd
    assert (job.batch, job.heads, job.kv_heads, job.seq, job.bkv) == (2, 6, 2, 8192, 4)
    assert "odd" not in job.why
    assert "(B*KV=4 backward samples, B*H=12 forward batch;" in job.label()


def test_kernel_pair_plan_odd_bkv_at_lnc2():
    # KV per device odd (8 / 8 = 1), job B*KV = 2 even: B = 1 added, odd at LNC=2
    shapes = plan(batch=2, model_axis=8, lnc=2)
    assert [(s.batch, s.bkv) for s in shapes] == [(2, 2), (1, 1)]
    assert "odd B*KV at LNC=2" in shapes[1].why
    # the job's own B*KV odd: that shape, marked, nothing added
    (job,) = plan(batch=3, model_axis=8, lnc=2)
    assert job.bkv == 3 and "odd B*KV at LNC=2" in job.why
    # LNC=1: one core, no split, the job's shape only
    assert [s.bkv for s in plan(batch=2, model_axis=8, lnc=1)] == [2]


def test_job_pair_plan_from_the_fuji_3b_config():
    cfg = load_config("configs/fuji-3b-trn2.toml", ["trainer.accum_steps=1"])
    # 32 nodes x 64 devices, model 2: 1024 batch shards, 2048 / (1 x 1024) = 2 sequences each;
    # 12 of the 24 heads and 4 of the 8 KV heads per device: B*KV = 8 is even, and so is KV
    (job,) = node_rows.job_pair_plan(cfg, 32 * 64, lnc=2)
    assert job == PairShape(2, 12, 4, 8192, 128, "the job's per-device shape")
    # k=2 (the config's): 2048 / (2 x 1024) = 1 sequence
    k2 = load_config("configs/fuji-3b-trn2.toml")
    assert node_rows.job_pair_plan(k2, 32 * 64, lnc=2)[0].batch == 1
    # one node: 32 shards, 2048 / (4 x 32) = 16 sequences per device
    k4 = load_config("configs/fuji-3b-trn2.toml", ["trainer.accum_steps=4"])
    (one,) = node_rows.job_pair_plan(k4, 64, lnc=2)
    assert (one.batch, one.bkv) == (16, 64)
    auto = load_config("configs/fuji-3b-trn2.toml", ['trainer.accum_steps="auto"'])
    assert node_rows.job_pair_plan(auto, 64, lnc=2)[0].batch == 1


@pytest.mark.parametrize("k, shards, want", [(1, 16, 128), (4, 512, 1), ("auto", 8, 1)])
def test_per_device_batch(k, shards, want):
    assert node_rows.per_device_batch(2048, k, shards) == want
