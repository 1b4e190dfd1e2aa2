"""The CPU fallback: XLA flags for emulated CPU devices, and a process's JAX backend set to N of
them before it starts (`dry-run`, `neuron-check` off Neuron; `train`, `check-config` and `eval`
with the count their config's mesh needs, `emulate_for_config`). XLA fixes the device count
when its backend starts, so a process whose backend already runs with another count answers
False and the command re-runs itself in a subprocess."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping

# A mesh with a -1 axis takes the most devices up to this count whose batch split works (8:
# the tiny config's 4 x 2 mesh, one row per device); a mesh of fixed sizes takes their product.
CPU_MESH_DEVICES = 8
COUNT_FLAG = "--xla_force_host_platform_device_count"

# XLA:CPU's concurrency-optimized scheduler may order collectives differently on different
# emulated devices, and the step then deadlocks in a rendezvous (seen on jax 0.10.2: the tiny
# config at accum_steps=2 hung in 3 of 3 runs within 30 steps; 0 of 4 with this flag).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def cpu_fallback_flags(environ=os.environ) -> None:
    """Adds `CPU_XLA_FLAGS` to XLA_FLAGS when this process runs on the CPU fallback
    (JAX_PLATFORMS starting with cpu, or emulated host devices), before JAX starts; a flag
    the user already set wins. Never touches a Neuron run."""
    flags = environ.get("XLA_FLAGS", "")
    on_cpu = environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu"
    if not (on_cpu or "--xla_force_host_platform_device_count" in flags):
        return
    for flag in CPU_XLA_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    environ["XLA_FLAGS"] = flags


def emulate_cpu_devices(devices: int, extra_flags: str = "") -> bool:
    """Whether this process runs `devices` emulated CPU devices, after asking for them: sets
    the device count (and `extra_flags`) in XLA_FLAGS and the CPU platform, then asks JAX's
    backend (which starts with them unless it already runs). A backend that already runs with
    another platform or device count answers False, and the environment is put back as it
    was."""
    import jax

    saved = {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS")}
    saved_platforms = jax.config.jax_platforms
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    count = f"--xla_force_host_platform_device_count={devices}"
    os.environ["XLA_FLAGS"] = f"{flags} {extra_flags} {count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    cpu_fallback_flags()
    jax.config.update("jax_platforms", "cpu")
    if jax.default_backend() == "cpu" and jax.device_count() == devices:
        return True
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    jax.config.update("jax_platforms", saved_platforms)
    return False


def devices_for_mesh(axes: Mapping[str, int], global_batch: int, accum_steps) -> int | None:
    """The emulated device count a mesh of `axes` ({"data": -1, "fsdp": 2, "model": 1}) runs
    on in the CPU fallback: the product of its sizes; with a -1, the largest multiple of the
    other sizes up to `CPU_MESH_DEVICES` whose batch split works (an integer `accum_steps`
    divides the batch with the batch shards), else the largest multiple. None for sizes the
    config loader refuses (it names them)."""
    from trn_accum.core.batch_rules import divisibility_error
    from trn_accum.core.mesh import resolve_axes
    from trn_accum.model.sharding import BATCH_AXES

    try:
        known = math.prod(s for s in axes.values() if s != -1)
        counts = [n for n in range(max(CPU_MESH_DEVICES, known), 0, -1) if n % known == 0]
        if -1 not in axes.values():
            counts = [known]
        shapes = [resolve_axes(axes, n) for n in counts]
    except (ValueError, TypeError, ZeroDivisionError):
        return None
    if not isinstance(accum_steps, int) or accum_steps < 1:  # "auto": chosen on the mesh
        return counts[0]
    for n, shape in zip(counts, shapes, strict=True):
        shards = math.prod(shape.get(a, 1) for a in BATCH_AXES)
        if divisibility_error(global_batch, accum_steps, shards) is None:
            return n
    return counts[0]


def on_cpu_fallback(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this single process's JAX will run on its CPU fallback, decided before any
    backend starts: the platform setting names cpu first, or it is empty and neither Neuron
    nor another accelerator plugin (TPU's libtpu, a `jax_plugins` entry point) is installed;
    and the launch environment names one process (a multi-process job sizes its own devices).
    """
    from trn_accum.cluster.launch_plan import derive_launch
    from trn_accum.neuron import platform

    jax = sys.modules.get("jax") if environ is os.environ else None
    setting = jax.config.jax_platforms if jax is not None else None  # a jax.config.update wins
    first = (setting or environ.get("JAX_PLATFORMS", "")).split(",")[0].strip()
    if first and first != "cpu":
        return False
    if not first and (platform.neuron_plugin_installed() or _accelerator_plugins()):
        return False
    try:
        return not derive_launch(environ, neuron=False, resolve=lambda host: host).distributed
    except ValueError:  # a broken launch environment: the trainer names it
        return False


def _accelerator_plugins() -> list[str]:
    """Installed JAX plugins that may take the default backend from the CPU."""
    names = ["libtpu"] if importlib.util.find_spec("libtpu") is not None else []
    try:
        names += [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    except Exception:  # malformed metadata of some unrelated distribution
        pass
    return names


def emulate_for_mesh(axes, global_batch, accum_steps, argv: list[str]) -> int | None:
    """On the CPU fallback, gives a mesh of `axes` its emulated devices (`devices_for_mesh`)
    before JAX's backend starts, with one line on stderr saying so; elsewhere (Neuron, TPU, a
    multi-process job, a device count the user set in XLA_FLAGS, a mesh of one device) it
    changes nothing. Returns None to go on in this process, or the exit code of the command
    re-run in a subprocess (this process's backend already ran with another count)."""
    devices = devices_for_mesh(axes, global_batch, accum_steps)
    if (
        devices is None
        or devices == 1
        or COUNT_FLAG in os.environ.get("XLA_FLAGS", "")
        or not on_cpu_fallback()
    ):
        return None
    if not emulate_cpu_devices(devices):  # a fresh process sets the count before its backend
        return subprocess.call([sys.executable, "-m", "trn_accum.cli", *argv])
    sizes = ", ".join(f"{a}={s}" for a, s in axes.items())
    print(
        f"trn-accum: CPU fallback: the mesh ({sizes}) runs on {devices} emulated CPU devices "
        f"(no Neuron or TPU here; {COUNT_FLAG}=N in XLA_FLAGS sets another count)",
        file=sys.stderr,
        flush=True,
    )
    return None


def emulate_for_config(cfg, argv: list[str]) -> int | None:
    """`emulate_for_mesh` for a loaded `trn_accum.config.Config` (train, check-config)."""
    return emulate_for_mesh(cfg.mesh.axes(), cfg.data.global_batch, cfg.trainer.accum_steps, argv)


def emulate_for_run_dir(run_dir: str, argv: list[str]) -> int | None:
    """`emulate_for_mesh` for the mesh of the run in `run_dir` (its RUN_DIR/config.json, the
    record the trainer writes): what `eval` calls before its backend starts. A run dir without
    a readable record changes nothing (the command names what is missing)."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            record = json.load(f)
        axes = {a: int(record["mesh"][a]) for a in ("data", "fsdp", "model")}
        batch, k = record["data"]["global_batch"], record["trainer"]["accum_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return emulate_for_mesh(axes, batch, k, argv)
