"""The CPU fallback: XLA flags for emulated CPU devices, and a process's JAX backend set to N of
them before it starts (`dry-run`, `neuron-check` off Neuron). XLA fixes the device count when
its backend starts, so a process whose backend already runs with another count answers False
and the command re-runs itself in a subprocess."""

from __future__ import annotations

import os
import re

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


def emulate_cpu_devices(devices: int) -> bool:
    """Whether this process runs `devices` emulated CPU devices, after asking for them: sets
    the device count in XLA_FLAGS and the CPU platform, then asks JAX's backend (which starts
    with them unless it already runs). A backend that already runs with another platform or
    device count answers False, and the environment is put back as it was."""
    import jax

    saved = {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS")}
    saved_platforms = jax.config.jax_platforms
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
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
