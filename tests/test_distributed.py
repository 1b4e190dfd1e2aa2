"""trn_accum.distributed: the launch plan from an environment (pure), and real jax.distributed
runs of 2 processes x 4 CPU devices on localhost (tests/multiprocess.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from multiprocess import (
    cpu_env,
    free_port,
    run_processes,
    tagged_json,
)

from trn_accum.cluster import distributed as dist
from trn_accum.cluster import rootport
from trn_accum.cluster.distributed import LaunchError, derive_launch, expand_nodelist

# The root hosts these tests name, as a cluster's DNS would resolve them; any other name does
# not resolve (socket.gaierror, what getaddrinfo raises).
REAL_RESOLVE = rootport.resolve_ipv4
FAKE_DNS = {"trn2-001": "10.0.0.11", "a": "10.0.0.12", "fuji-3b-0.fuji-3b": "10.0.0.13"}


def fake_resolve(host: str) -> str:
    if host not in FAKE_DNS:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return FAKE_DNS[host]


@pytest.fixture(autouse=True)
def cluster_dns(monkeypatch):
    """derive_launch resolves the root host through rootport.resolve_ipv4: the cluster's DNS."""
    monkeypatch.setattr(rootport, "resolve_ipv4", fake_resolve)


def slurm_env(nodelist: str, ntasks: int, procid: int, job_id: int = 4321, **extra) -> dict:
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": "0",
        **extra,
    }


def k8s_env(nodes: int, index: int, **extra) -> dict:
    return {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "JOB_COMPLETION_INDEX": str(index),
        "TRN_ACCUM_NUM_PROCESSES": str(nodes),
        "TRN_ACCUM_JOB_NAME": "fuji-3b",
        "TRN_ACCUM_SUBDOMAIN": "fuji-3b",
        **extra,
    }


# ----------------------------------------------------------------------------- node lists


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("trn2-001", ["trn2-001"]),
        ("a,b", ["a", "b"]),
        (
            "trn2-[001-004,007],other5",
            ["trn2-001", "trn2-002", "trn2-003", "trn2-004", "trn2-007", "other5"],
        ),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("ip-10-1-2-3,trn2-[1,3]", ["ip-10-1-2-3", "trn2-1", "trn2-3"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "trn2-[001-", "a,,b", "n[3-1]", "n[x]", "n]1[", "a b", "n[]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST") as e:
        expand_nodelist(bad)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- derive_launch


def test_single_process():
    plan = derive_launch({}, neuron=True)
    assert (plan.mode, plan.num_processes, plan.process_id, plan.coordinator) == (
        "single",
        1,
        0,
        None,
    )
    # one process still runs collectives: the runtime's root address is this host
    assert plan.neuron_env == {"NEURON_RT_ROOT_COMM_ID": "127.0.0.1:41000"}
    preset = {"NEURON_RT_ROOT_COMM_ID": "10.0.0.9:5000"}
    assert derive_launch(preset, neuron=True).neuron_env == preset
    port = derive_launch({"TRN_ACCUM_NEURON_ROOT_PORT": "43000"}, neuron=True).neuron_env
    assert port == {"NEURON_RT_ROOT_COMM_ID": "127.0.0.1:43000"}
    assert derive_launch({}, neuron=False).neuron_env == {}


def test_slurm_one_node_one_task_is_single():
    plan = derive_launch(slurm_env("trn2-001", 1, 0), neuron=True)
    assert (plan.mode, plan.num_processes, plan.hosts) == ("single", 1, ("trn2-001",))


def test_slurm_two_nodes():
    plan = derive_launch(slurm_env("trn2-[001-002]", 2, 1, job_id=4097), neuron=True)
    assert plan.mode == "slurm"
    assert (plan.num_processes, plan.process_id) == (2, 1)
    assert plan.coordinator == "trn2-001:61441"  # 4097 % 4096 + 61440
    assert plan.neuron_env == {
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": "64,64",
        "NEURON_PJRT_PROCESS_INDEX": "1",
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.11:41000",  # trn2-001's address
    }


def test_slurm_sixteen_nodes():
    nodes = "trn2-[001-004,007],trn2-[010-020]"
    plan = derive_launch(slurm_env(nodes, 16, 15, job_id=12), neuron=True)
    assert len(plan.hosts) == 16 and plan.hosts[15] == "trn2-020"
    assert plan.coordinator == "trn2-001:61452"
    assert plan.neuron_env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == ",".join(["64"] * 16)
    assert plan.neuron_env["NEURON_PJRT_PROCESS_INDEX"] == "15"
    assert plan.neuron_env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.11:41000"


def test_slurm_off_neuron_sets_no_neuron_env():
    assert derive_launch(slurm_env("a,b", 2, 0), neuron=False).neuron_env == {}
    # neuron=None reads JAX_PLATFORMS
    assert derive_launch(slurm_env("a,b", 2, 0, JAX_PLATFORMS="cpu")).neuron_env == {}
    assert derive_launch(slurm_env("a,b", 2, 0, JAX_PLATFORMS="neuron,cpu")).neuron_env


@pytest.mark.parametrize(
    "nodelist, job_id, port",
    [
        ("trn2-001", 7, None),
        ("trn2-[001-004,007],other5", 123456, None),
        ("n[08-10],m1", 4095, None),
        ("ip-10-0-0-1,ip-10-0-0-2", 99, "12345"),
    ],
)
def test_slurm_coordinator_matches_jax_detection(monkeypatch, nodelist, job_id, port):
    """The plan mirrors JAX's own Slurm detection, which `initialize` uses inside srun."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    env = slurm_env(nodelist, 4, 2, job_id=job_id)
    if port:
        env["JAX_COORDINATOR_PORT"] = port
    for k in [k for k in os.environ if k.startswith(("SLURM_", "JAX_COORDINATOR"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert SlurmCluster.is_env_present()
    jax_coord = SlurmCluster.get_coordinator_address(None, port)
    plan = derive_launch(env)
    assert plan.coordinator == jax_coord
    assert (plan.num_processes, plan.process_id) == (
        SlurmCluster.get_process_count(),
        SlurmCluster.get_process_id(),
    )


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_kubernetes(nodes):
    plan = derive_launch(k8s_env(nodes, nodes - 1), neuron=True)
    if nodes == 1:
        assert (plan.mode, plan.num_processes) == ("single", 1)
        assert plan.neuron_env == {"NEURON_RT_ROOT_COMM_ID": "127.0.0.1:41000"}  # this host
        return
    assert plan.mode == "kubernetes"
    assert (plan.num_processes, plan.process_id) == (nodes, nodes - 1)
    assert plan.coordinator == "fuji-3b-0.fuji-3b:55527"
    assert plan.hosts[-1] == f"fuji-3b-{nodes - 1}.fuji-3b"
    assert plan.neuron_env == {
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join(["64"] * nodes),
        "NEURON_PJRT_PROCESS_INDEX": str(nodes - 1),
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.13:41000",  # fuji-3b-0.fuji-3b's address
    }


def test_kubernetes_port_and_coordinator_override():
    plan = derive_launch(k8s_env(4, 2, TRN_ACCUM_COORDINATOR_PORT="9000"))
    assert plan.coordinator == "fuji-3b-0.fuji-3b:9000"
    plan = derive_launch(k8s_env(4, 2, TRN_ACCUM_COORDINATOR="10.1.2.3:8476"))
    assert plan.coordinator == "10.1.2.3:8476"


def test_explicit_arguments_and_env():
    plan = derive_launch({}, coordinator="h0:1234", num_processes=3, process_id=2)
    assert (plan.mode, plan.coordinator, plan.num_processes, plan.process_id) == (
        "explicit",
        "h0:1234",
        3,
        2,
    )
    env = {
        "TRN_ACCUM_COORDINATOR": "h0:1234",
        "TRN_ACCUM_NUM_PROCESSES": "2",
        "TRN_ACCUM_PROCESS_ID": "1",
    }
    assert derive_launch(env).process_id == 1
    # explicit values win over the launcher's
    assert derive_launch({**slurm_env("a,b", 2, 0), **env}).mode == "explicit"


def test_neuron_devices_per_process_and_preset_values_win():
    env = slurm_env("a,b", 2, 1)
    lnc1 = derive_launch({**env, "NEURON_LOGICAL_NC_CONFIG": "1"}, neuron=True)
    assert lnc1.neuron_env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "128,128"
    cores = derive_launch({**env, "NEURON_RT_VISIBLE_CORES": "0-15,32-47"}, neuron=True)
    assert cores.neuron_env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "32,32"
    preset = derive_launch(
        {**env, "NEURON_RT_ROOT_COMM_ID": "10.0.0.9:5000", "TRN_ACCUM_NEURON_ROOT_PORT": "7"},
        neuron=True,
    )
    assert preset.neuron_env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.9:5000"
    port = derive_launch({**env, "TRN_ACCUM_NEURON_ROOT_PORT": "43000"}, neuron=True)
    assert port.neuron_env["NEURON_RT_ROOT_COMM_ID"] == "10.0.0.12:43000"


def test_root_host_resolved_through_the_resolver_given():
    seen = []

    def resolve(host):
        seen.append(host)
        return "192.0.2.7"

    plan = derive_launch(slurm_env("trn2-[001-002]", 2, 0), neuron=True, resolve=resolve)
    assert plan.neuron_env["NEURON_RT_ROOT_COMM_ID"] == "192.0.2.7:41000"
    assert seen == ["trn2-001"]  # process 0's host, once
    # a preset value wins and is not resolved (the user's, as given)
    seen.clear()
    env = slurm_env("trn2-[001-002]", 2, 0, NEURON_RT_ROOT_COMM_ID="root.example:5000")
    assert derive_launch(env, neuron=True, resolve=resolve).neuron_env[
        "NEURON_RT_ROOT_COMM_ID"
    ] == ("root.example:5000")
    assert seen == []
    # off Neuron nothing is resolved
    derive_launch(slurm_env("nowhere-[1-2]", 2, 0), neuron=False, resolve=resolve)
    assert seen == []


def test_root_host_that_does_not_resolve_is_one_line_naming_it():
    env = slurm_env("nowhere-[1-2]", 2, 1)
    with pytest.raises(LaunchError) as e:
        derive_launch(env, neuron=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "'nowhere-1'" in msg and "NEURON_RT_ROOT_COMM_ID=<ip of nowhere-1>:41000" in msg
    assert "Name or service not known" in msg


def test_real_resolver_localhost_and_unresolvable():
    """The default resolver itself (captured before the fake DNS fixture patches it)."""
    assert rootport.root_comm_id("localhost", 41000, resolve=REAL_RESOLVE) == "127.0.0.1:41000"
    assert rootport.root_comm_id("10.1.2.3", 41000, resolve=REAL_RESOLVE) == "10.1.2.3:41000"
    with pytest.raises(ValueError, match="'no-such-host.invalid'") as e:
        rootport.root_comm_id("no-such-host.invalid", 41000, resolve=REAL_RESOLVE)
    assert "\n" not in str(e.value)


def test_initialize_waits_for_a_pods_name_but_not_a_slurm_nodes(monkeypatch):
    """A pod's DNS name appears once the pod has an address: initialize retries it (poll 2 s)
    up to initialization_timeout; a Slurm node's name is tried once."""
    calls = []

    def never(host):
        calls.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rootport, "resolve_ipv4", never)
    with pytest.raises(LaunchError, match="'nowhere-1'"):
        dist.initialize(slurm_env("nowhere-[1-2]", 2, 1), neuron=True, initialization_timeout=3)
    assert calls == ["nowhere-1"]
    calls.clear()
    with pytest.raises(LaunchError, match="'fuji-3b-0.fuji-3b'"):
        dist.initialize(k8s_env(2, 1), neuron=True, initialization_timeout=3)
    assert calls == ["fuji-3b-0.fuji-3b"] * 2  # at 0 s and 2 s, then the timeout


def test_resolve_waiting_retries_until_the_timeout():
    clock = [0.0]
    calls = []

    def resolve(host, ready_at=6.0):
        calls.append(clock[0])
        if clock[0] < ready_at:
            raise socket.gaierror(socket.EAI_NONAME, "not yet")
        return "10.0.0.5"

    def sleep(s):
        clock[0] += s

    timing = {"poll_s": 2, "sleep": sleep, "clock": lambda: clock[0]}
    assert rootport.resolve_waiting("pod-0.job", 10, resolve=resolve, **timing) == "10.0.0.5"
    assert calls == [0, 2, 4, 6]
    clock[0], calls[:] = 0.0, []
    with pytest.raises(OSError, match="not yet"):  # 3 s: tries at 0 and 2, then gives up
        rootport.resolve_waiting("pod-0.job", 3, resolve=resolve, **timing)
    assert calls == [0, 2]
    clock[0], calls[:] = 0.0, []
    with pytest.raises(OSError):  # 0 s: one attempt
        rootport.resolve_waiting("pod-0.job", 0, resolve=resolve, **timing)
    assert calls == [0]


BAD = {
    # missing rank
    "k8s index empty": (k8s_env(4, 0, JOB_COMPLETION_INDEX=""), "JOB_COMPLETION_INDEX"),
    "slurm rank missing": (
        {k: v for k, v in slurm_env("a,b", 2, 0).items() if k != "SLURM_PROCID"},
        "no SLURM_PROCID",
    ),
    "explicit rank missing": (
        {"TRN_ACCUM_PROCESS_ID": " ", "TRN_ACCUM_NUM_PROCESSES": "2"},
        None,
    ),
    # rank >= world size
    "slurm rank too big": (slurm_env("a,b", 2, 2), "SLURM_PROCID=2"),
    "k8s rank too big": (k8s_env(4, 4), "JOB_COMPLETION_INDEX=4"),
    "explicit rank too big": (
        {
            "TRN_ACCUM_PROCESS_ID": "3",
            "TRN_ACCUM_NUM_PROCESSES": "3",
            "TRN_ACCUM_COORDINATOR": "h:1",
        },
        "TRN_ACCUM_PROCESS_ID=3",
    ),
    # unparsable values
    "nodelist": (slurm_env("trn2-[001-", 2, 0), "SLURM_STEP_NODELIST"),
    "rank not int": (slurm_env("a,b", 2, 0, SLURM_PROCID="one"), "SLURM_PROCID='one'"),
    "negative rank": (k8s_env(2, -1), "JOB_COMPLETION_INDEX=-1"),
    "world zero": (slurm_env("a", 0, 0), "SLURM_NTASKS=0"),
    "k8s world missing": (
        {k: v for k, v in k8s_env(2, 0).items() if k != "TRN_ACCUM_NUM_PROCESSES"},
        "TRN_ACCUM_NUM_PROCESSES",
    ),
    "k8s subdomain missing": (k8s_env(2, 0, TRN_ACCUM_SUBDOMAIN=""), "TRN_ACCUM_SUBDOMAIN"),
    "explicit no coordinator": (
        {"TRN_ACCUM_PROCESS_ID": "0", "TRN_ACCUM_NUM_PROCESSES": "2"},
        "TRN_ACCUM_COORDINATOR",
    ),
    "bad coordinator": (
        {"TRN_ACCUM_PROCESS_ID": "0", "TRN_ACCUM_NUM_PROCESSES": "2", "TRN_ACCUM_COORDINATOR": "h"},
        "host:port",
    ),
    "batch script not step": (
        {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
        "srun trn-accum train",
    ),
    "port out of range": (k8s_env(2, 0, TRN_ACCUM_COORDINATOR_PORT="70000"), "1..65535"),
    "bad lnc": (
        slurm_env("a,b", 2, 0, NEURON_LOGICAL_NC_CONFIG="4", JAX_PLATFORMS="neuron"),
        "NEURON_LOGICAL_NC_CONFIG=4",
    ),
    "bad visible cores": (
        slurm_env("a,b", 2, 0, NEURON_RT_VISIBLE_CORES="0-", JAX_PLATFORMS="neuron"),
        "NEURON_RT_VISIBLE_CORES",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_environments_are_one_line_errors(name):
    env, fragment = BAD[name]
    with pytest.raises(LaunchError) as e:
        derive_launch(env)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "\n" not in msg and len(msg) < 300
    if fragment:
        assert fragment in msg


def test_bad_explicit_arguments():
    with pytest.raises(LaunchError, match="process_id=2 is not below num_processes=2"):
        derive_launch({}, coordinator="h:1", num_processes=2, process_id=2)
    with pytest.raises(LaunchError, match="process_id is not set"):
        derive_launch({}, coordinator="h:1", num_processes=2)


def test_initialize_single_process_starts_nothing():
    import jax

    info = dist.initialize({}, neuron=False)
    assert (info.mode, info.process_id, info.num_processes) == ("single", 0, 1)
    assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- 2 x 4 devices

# Shared by the 2-process run and the single 8-device reference: a masked regression loss
# (uneven weights per minibatch), accumulated over 4 strided minibatches with the batch over
# ("data", "fsdp") = (4, 2) and w1 sharded over "fsdp".
ACCUM_PROGRAM = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from trn_accum.core.accumulate import accumulate_gradients
    from trn_accum.core.mesh import build_mesh

    def compute():
        mesh = build_mesh({"data": -1, "fsdp": 2})
        rng = np.random.default_rng(0)
        B, D, H = 64, 16, 8
        host_batch = {
            "x": rng.normal(size=(B, D)).astype(np.float32),
            "y": rng.normal(size=(B,)).astype(np.float32),
            "m": (rng.random(B) > 0.4).astype(np.float32),
        }
        host_params = {
            "w1": (0.3 * rng.normal(size=(D, H))).astype(np.float32),
            "w2": (0.3 * rng.normal(size=(H,))).astype(np.float32),
        }
        batch_spec = P(("data", "fsdp"))
        param_specs = {"w1": P("fsdp", None), "w2": P()}

        def put(v, spec):
            s = NamedSharding(mesh, spec)
            return jax.make_array_from_callback(v.shape, s, lambda idx: v[idx])

        batch = {k: put(v, batch_spec) for k, v in host_batch.items()}
        params = {k: put(v, param_specs[k]) for k, v in host_params.items()}

        def loss_fn(p, b):
            pred = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
            return jnp.sum(b["m"] * (pred - b["y"]) ** 2) / jnp.maximum(jnp.sum(b["m"]), 1.0)

        grad_fn = accumulate_gradients(
            loss_fn, steps=4, mesh=mesh, batch_spec=batch_spec, param_specs=param_specs,
            weight_fn=lambda mb: jnp.sum(mb["m"]),
        )
        loss, grads = jax.jit(grad_fn)(params, batch)
        out = multihost_utils.process_allgather({"loss": loss, **grads}, tiled=True)
        return {k: np.asarray(v) for k, v in out.items()}
    """
)

ACCUM_WORKER = (
    "import sys\n"
    "from trn_accum.cluster.distributed import initialize\n"
    "info = initialize()\n"
    + ACCUM_PROGRAM
    + textwrap.dedent(
        """
        import jax
        assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 4, 8)
        out = compute()
        if info.process_id == 0:
            np.savez(sys.argv[1], **out)
        print(f"RESULT {info.process_id} of {info.num_processes} {info.mode}")
        """
    )
)


def test_accumulated_gradients_two_processes_equal_one_process(tmp_path):
    """2 processes x 4 CPU devices via jax.distributed == 1 process x 8 devices."""
    out = tmp_path / "grads.npz"
    results = run_processes([*("-c", ACCUM_WORKER), str(out)], 2, devices_per_process=4)
    assert [r.tagged("RESULT") for r in results] == ["0 of 2 explicit", "1 of 2 explicit"]
    multi = dict(np.load(out))

    scope: dict = {}
    exec(ACCUM_PROGRAM, scope)  # this process: 8 devices
    single = scope["compute"]()
    assert set(multi) == set(single) == {"loss", "w1", "w2"}
    for k in single:
        np.testing.assert_allclose(multi[k], single[k], rtol=1e-6, atol=0, err_msg=k)
    assert np.abs(single["w1"]).max() > 1e-3  # a real gradient, not zeros


NEURON_WORKER = textwrap.dedent(
    """
    import os, json
    from trn_accum.cluster.distributed import initialize
    info = initialize(neuron=True)   # the Neuron path, run on CPU: env + PRNG, then jax.distributed
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    total = multihost_utils.process_allgather(jnp.float32(info.process_id + 1)).sum()
    print("RESULT " + json.dumps({
        "env": {k: os.environ.get(k) for k in (
            "NEURON_PJRT_PROCESSES_NUM_DEVICES", "NEURON_PJRT_PROCESS_INDEX",
            "NEURON_RT_ROOT_COMM_ID")},
        "prng": str(jax.config.jax_default_prng_impl),
        "index": jax.process_index(), "count": jax.process_count(), "sum": float(total),
    }))
    """
)


def test_initialize_neuron_path_exports_env_and_rbg():

    results = run_processes(
        NEURON_WORKER, 2, devices_per_process=4, env={"TRN_ACCUM_DEVICES_PER_PROCESS": "4"}
    )
    outs = [tagged_json(r.stdout, "RESULT") for r in results]
    for i, o in enumerate(outs):
        assert o["env"] == {
            "NEURON_PJRT_PROCESSES_NUM_DEVICES": "4,4",
            "NEURON_PJRT_PROCESS_INDEX": str(i),
            "NEURON_RT_ROOT_COMM_ID": "127.0.0.1:41000",
        }
        assert o["prng"] == "rbg"
        assert (o["index"], o["count"], o["sum"]) == (i, 2, 3.0)


FATE_WORKER = textwrap.dedent(
    """
    import time
    from trn_accum.cluster.distributed import initialize
    info = initialize(heartbeat_timeout_seconds=5)
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("up")
    print("\\nrank-is-up", flush=True)  # gloo writes to this stdout too, without a newline
    time.sleep(120)
    """
)


def test_a_dead_peer_makes_the_other_process_exit(tmp_path):
    """The premise of the EKS failure policy: when one rank dies, every other rank exits
    non-zero on its own (JAX's coordination service), so all pods fail and are replaced."""
    port = free_port()
    procs = []
    try:
        for i in range(2):
            env = cpu_env(
                4,
                {
                    "TRN_ACCUM_COORDINATOR": f"127.0.0.1:{port}",
                    "TRN_ACCUM_NUM_PROCESSES": "2",
                    "TRN_ACCUM_PROCESS_ID": str(i),
                },
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", FATE_WORKER],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=open(tmp_path / f"rank{i}.err", "w"),
                    text=True,
                    start_new_session=True,
                )
            )
        for i, p in enumerate(procs):  # wait until both ranks are past a global barrier
            seen = []
            for line in iter(p.stdout.readline, ""):
                seen.append(line)
                if "rank-is-up" in line:
                    break
            err = (tmp_path / f"rank{i}.err").read_text()[-3000:]
            out = "".join(seen)[-3000:]
            assert "rank-is-up" in out, f"rank {i} never came up:\nstdout:\n{out}\nstderr:\n{err}"
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=60)
        assert rc != 0, "rank 0 kept running after rank 1 died"
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
