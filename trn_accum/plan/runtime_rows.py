"""`neuron-check`'s rows about the node and its runtime: platform, lnc, topology, prng, psum,
psum-procs, checkpoint and cache. Each row takes the `Check` and returns (status, one-line
detail)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.checkpoint.checkpointer import Checkpointer
from trn_accum.config.mesh_rules import make_mesh
from trn_accum.neuron import platform, topology
from trn_accum.plan.node_rows import FAIL, PASS, SKIP
from trn_accum.plan.probe import Check


def row_platform(c: Check) -> tuple[str, str]:
    n, backend = len(c.devices), jax.default_backend()
    detail = f"backend {backend}, {n} devices in this process, {jax.device_count()} in the job"
    if not c.on_neuron:
        return PASS, detail + " (not Neuron: the Neuron rows below use CPU stand-ins)"
    want = _neuron_devices_expected()
    if want is not None and n != want:
        return FAIL, f"{detail}; expected {want} ({_chips()} chips x 8 cores / LNC)"
    return PASS, detail


def _chips() -> int:
    return len(glob.glob("/dev/neuron[0-9]*"))


def _neuron_devices_expected() -> int | None:
    """Devices this process should see: Neuron chips x 8 physical cores / LNC (None when the
    cores are restricted with NEURON_RT_VISIBLE_CORES or no /dev/neuron* is visible)."""
    if os.environ.get("NEURON_RT_VISIBLE_CORES") or not _chips():
        return None
    return _chips() * platform.TRN2_CORES_PER_CHIP // platform.lnc_setting()


def row_lnc(c: Check) -> tuple[str, str]:
    runtime = (
        os.environ.get("NEURON_LOGICAL_NC_CONFIG") or f"unset (default {platform.DEFAULT_LNC})"
    )
    flag = platform.cc_flags_lnc(os.environ.get("NEURON_CC_FLAGS", ""))
    try:
        lnc = platform.lnc_setting()
    except ValueError as e:
        return FAIL, str(e)
    detail = f"runtime NEURON_LOGICAL_NC_CONFIG {runtime}, compiler --lnc {flag or 'not given'}"
    detail += f"; kernels launched [lnc={lnc}]"
    if c.on_neuron:
        want = _neuron_devices_expected()
        got = len(c.devices)
        if want is not None and got != want:
            return FAIL, f"{detail}; the runtime gives {got} devices, LNC={lnc} gives {want}"
        detail += f"; runtime gives {got} devices"
    return PASS, detail


def row_topology(c: Check) -> tuple[str, str]:
    """The config's mesh on this node's cores: no model or fsdp group spans Neuron devices
    that `neuron-ls --topology` does not show connected (`trn_accum.neuron.topology`). Runs
    where neuron-ls exists and the backend is Neuron; skipped elsewhere, named so."""
    exe = shutil.which("neuron-ls")
    if exe is None or not c.on_neuron:
        why = "neuron-ls not found" if exe is None else "the backend is not Neuron"
        return SKIP, f"{why}: the mesh's NeuronCore connectivity is checked on a trn2 node"
    try:
        out = subprocess.run(
            [exe, "--topology"], capture_output=True, text=True, timeout=60, check=True
        )
        topo = topology.parse_topology(out.stdout)
        lnc = platform.lnc_setting()
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return FAIL, f"neuron-ls --topology: {str(e).strip().splitlines()[0] if str(e) else e!r}"
    mesh = make_mesh(c.cfg, c.job_devices)
    local = jax.local_devices()
    cores = topology.visible_cores(os.environ.get("NEURON_RT_VISIBLE_CORES"), len(local))
    grid = topology.core_grid(mesh.devices, local, cores)
    axes = [a for a in topology.LINKED_AXES if mesh.shape.get(a, 1) > 1]
    groups = {a: topology.axis_groups(grid, mesh.axis_names, a) for a in axes}
    bad = topology.disconnected_groups(groups, topo, topology.core_device(topo, lnc))
    shape = " x ".join(f"{a} {n}" for a, n in mesh.shape.items())
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return FAIL, (
            f"mesh {shape}: {bad[0]}{more}, which are not connected (Neuron lists meshes over "
            f"unconnected cores as crashing): pick mesh.model / mesh.fsdp sizes whose groups "
            f"stay on linked devices, or the cores (NEURON_RT_VISIBLE_CORES) to match"
        )
    return PASS, f"mesh {shape}: {', '.join(axes) or 'no'} groups on connected devices " + (
        f"({len(topo.links)} Neuron devices, LNC={lnc})"
    )


def row_prng(c: Check) -> tuple[str, str]:
    impl = platform.configure_prng("neuron" if c.on_neuron else "other")
    if c.on_neuron and impl != "rbg":
        return FAIL, f"PRNG {impl} on Neuron: the trainer must use rbg (threefry unsupported)"
    key = jax.random.key(0)
    eager = np.asarray(jax.random.normal(key, (1024,)))
    jitted = np.asarray(jax.jit(lambda k: jax.random.normal(k, (1024,)))(key))
    if not np.array_equal(eager, jitted):
        return FAIL, f"PRNG {impl}: a jitted draw differs from the eager one"
    return PASS, f"{impl}; jitted draw == eager draw"


def _psum(devices: Sequence[Any]) -> tuple[float, float]:
    """psum over `devices` of their indices: (got, exact n(n-1)/2)."""
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("all",))
    sharding = NamedSharding(mesh, P("all"))
    x = jax.make_array_from_callback(
        (n,), sharding, lambda idx: np.arange(n, dtype=np.float32)[idx]
    )
    f = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "all"), mesh=mesh, in_specs=P("all"), out_specs=P())
    )
    got = float(np.asarray(f(x).addressable_data(0))[0])
    return got, n * (n - 1) / 2


def row_psum(c: Check) -> tuple[str, str]:
    got, want = _psum(c.devices)
    status = PASS if got == want else FAIL
    return status, f"psum over {len(c.devices)} devices = {got:g} (exact {want:g})"


def row_psum_procs(c: Check) -> tuple[str, str]:
    if jax.process_count() == 1:
        return SKIP, "one process"
    got, want = _psum(jax.devices())
    status = PASS if got == want else FAIL
    return (
        status,
        f"psum over {jax.device_count()} devices of {jax.process_count()} processes = {got:g} "
        f"(exact {want:g})",
    )


def _shared_name() -> str:
    """One fresh directory name, the same on every process (process 0's draw, broadcast)."""
    token = np.asarray(int.from_bytes(os.urandom(4), "little") >> 1, np.int32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = multihost_utils.broadcast_one_to_all(token)
    return f".neuron-check-{int(token):x}"


def row_checkpoint(c: Check) -> tuple[str, str]:
    """A state sharded over every device of the job, saved and restored through the trainer's
    Checkpointer (orbax) in the run directory (shared storage in multi-node jobs)."""
    where = os.path.join(c.run_dir, _shared_name())
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.asarray(devices), ("all",))
    sharding = NamedSharding(mesh, P("all"))
    full = np.arange(len(devices) * 8, dtype=np.float32) * 0.1
    x = jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])
    state = {"x": x, "step": np.asarray(7, np.int32)}
    try:
        with Checkpointer(where, async_save=True) as ckpt:
            ckpt.save(1, state, force=True)
            ckpt.wait_until_finished()
            target = {
                "x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                "step": jax.ShapeDtypeStruct((), np.int32),
            }
            restored, _ = ckpt.restore(target, 1)
        shards = [np.asarray(s.data) for s in restored["x"].addressable_shards]
        want = [full[s.index] for s in restored["x"].addressable_shards]
        same = all(np.array_equal(a, b) for a, b in zip(shards, want, strict=True))
        if not same or int(restored["step"]) != 7:
            return FAIL, f"the state restored from {where} differs from the one saved"
        return PASS, f"saved and restored bit-exactly under {c.run_dir}"
    finally:
        if jax.process_index() == 0:
            shutil.rmtree(where, ignore_errors=True)


def _cache_dirs() -> list[tuple[str, str]]:
    env = platform.trn2_env() if platform.neuron_available() else dict(os.environ)
    return [
        (k, env[k]) for k in ("NEURON_COMPILE_CACHE_URL", "JAX_COMPILATION_CACHE_DIR") if env.get(k)
    ]


def row_cache(c: Check) -> tuple[str, str]:
    dirs = _cache_dirs()
    if not dirs:
        return (
            SKIP,
            "no compile cache configured (NEURON_COMPILE_CACHE_URL, JAX_COMPILATION_CACHE_DIR)",
        )
    seen = []
    for key, path in dirs:
        if "://" in path:
            seen.append(f"{key}={path} (a URL: not probed)")
            continue
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".neuron-check-"):
                pass
        except OSError as e:
            return (
                FAIL,
                f"{key}={path} is not writable ({e.strerror}): fix it or point it elsewhere",
            )
        seen.append(f"{key}={path} writable")
    return PASS, "; ".join(seen)
