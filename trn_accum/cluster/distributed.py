"""Start JAX's distributed runtime from wherever the process runs.

    info = initialize()          # first thing in the trainer, before any JAX computation

Where the process runs is derived by `trn_accum.cluster.launch_plan.derive_launch` (explicit
values, a Kubernetes Indexed Job, a Slurm job step, else one process), a pure function of
the environment; ``initialize`` starts JAX's distributed runtime from that plan.

Bad values raise ``LaunchError`` (a ``ValueError``) with one line naming the variable, the rule
and a fix; so do ranks that disagree on the process count (``trn_accum.cluster.agreement``: each
rank shows rank 0 its count before JAX starts, since JAX would use rank 0's and wait or run on).
A rank whose start fails (its config refused, an import error) calls ``fail_startup``, which
tells rank 0 and through it every other rank: all of them exit with the same line naming the
failing rank. A coordinator port held by another program, a coordinator that never answers and
a rank that never comes are named within ``TRN_ACCUM_STARTUP_TIMEOUT`` seconds (default 45) on
every rank (`trn_accum.cluster.agreement`).
A host whose own name gives gloo (JAX's CPU collectives) no address to bind is named the
same way, before JAX starts (`gloo_address_problem`).
JAX is imported inside ``initialize`` only: deriving a plan starts nothing. On Neuron,
``initialize`` also applies ``trn_accum.neuron.platform.trn2_env`` (the values
``launch/env/trn2.sh`` exports; what is already set wins) and selects the rbg PRNG.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import NoReturn

from trn_accum.cluster import agreement, rootport
from trn_accum.cluster.launch_plan import (
    DEFAULT_K8S_PORT,
    DEFAULT_NEURON_ROOT_PORT,
    LaunchPlan,
    derive_launch,
    slurm_coordinator_port,
)
from trn_accum.cluster.launch_values import LaunchError, expand_nodelist, int_value
from trn_accum.errors import UserError, one_line
from trn_accum.neuron import platform

__all__ = [
    "DEFAULT_K8S_PORT",
    "DEFAULT_NEURON_ROOT_PORT",
    "LaunchError",
    "LaunchPlan",
    "ProcessInfo",
    "derive_launch",
    "expand_nodelist",
    "fail_startup",
    "gloo_address_problem",
    "gloo_in_use",
    "initialize",
    "slurm_coordinator_port",
    "startup_timeout",
]

# seconds the ranks of a job wait for each other at start-up (TRN_ACCUM_STARTUP_TIMEOUT): a
# rank that never comes, or a coordinator that never answers, is named after this, so every
# rank of a job whose start failed exits within a minute
DEFAULT_STARTUP_TIMEOUT = 45


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """The result of `initialize`: this process in the job."""

    mode: str
    process_id: int
    num_processes: int
    coordinator: str | None
    neuron: bool
    plan: LaunchPlan


# ----------------------------------------------------------------------------- initialize


def startup_timeout(env: Mapping[str, str]) -> int:
    """`TRN_ACCUM_STARTUP_TIMEOUT` (seconds >= 1), else DEFAULT_STARTUP_TIMEOUT. Raise it where
    the ranks of a job start far apart (a node pulling its container image)."""
    name = "TRN_ACCUM_STARTUP_TIMEOUT"
    return int_value(name, env.get(name) or str(DEFAULT_STARTUP_TIMEOUT), minimum=1)


def fail_startup(error: UserError, env: Mapping[str, str] | None = None) -> NoReturn:
    """Raise `error` (this process's start-up failure: its config refused, an import error)
    after telling the rest of a multi-process job (`agreement.check_count(failed=...)`, within
    `startup_timeout`), so that every rank exits with one line naming the failing rank instead
    of waiting for it. A single process (or an environment that names no job) raises `error`
    as it is."""
    env = os.environ if env is None else env
    try:
        plan = derive_launch(env, neuron=False)
        timeout = startup_timeout(env)
    except LaunchError:
        raise error from None
    if not plan.distributed:
        raise error
    claim = agreement.Claim(plan.process_id, plan.num_processes, plan.num_processes_from)
    line = agreement.check_count(claim, str(plan.coordinator), timeout, failed=one_line(error))
    raise LaunchError(str(line), exit_code=error.exit_code) from None


def gloo_in_use(platforms: str | None, collectives: str | None) -> bool:
    """Whether JAX starts gloo in this process once `jax.distributed` runs: its CPU backend
    starts (`platforms`, the jax_platforms setting, unset or naming cpu) and the CPU
    collectives (`collectives`, jax_cpu_collectives_implementation) are gloo."""
    cpu = not platforms or "cpu" in [p.strip().lower() for p in platforms.split(",")]
    return cpu and collectives == "gloo"


def gloo_address_problem(hostname: str) -> str | None:
    """None when gloo can listen here; else one line naming `hostname` (this host's name).

    JAX gives gloo neither an address nor an interface, so gloo resolves the host's own name
    (getaddrinfo, IPv4 or IPv6) and binds the first address that binds: a name missing from
    /etc/hosts and DNS (some container runtimes) fails there, as does one resolving only to
    addresses of other hosts. GLOO_SOCKET_IFNAME is PyTorch's: JAX's gloo does not read it."""
    fix = (
        f"add '<this host's address> {hostname}' to /etc/hosts (127.0.0.1 when every process "
        f"runs on this host); JAX's gloo takes no interface setting (GLOO_SOCKET_IFNAME is "
        f"PyTorch's)"
    )
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        return (
            f"this host's name {hostname!r} does not resolve ({why}): JAX's CPU collectives "
            f"(gloo) listen on the address the host name resolves to; {fix}"
        )
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0, *address[2:]))
            return None
        except OSError:
            continue
    shown = ", ".join(sorted({str(info[4][0]) for info in infos}))
    return (
        f"this host's name {hostname!r} resolves to {shown}, no address of this host: JAX's "
        f"CPU collectives (gloo) listen on the address the host name resolves to; {fix}"
    )


def on_neuron() -> bool:
    """Whether the Neuron backend will run here: `trn_accum.neuron.platform.neuron_available()`
    (plugin installed, /dev/neuron* present, `JAX_PLATFORMS` allows it; nothing is started)."""
    return platform.neuron_available()


def initialize(
    env: Mapping[str, str] | None = None,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    neuron: bool | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
) -> ProcessInfo:
    """Start `jax.distributed` as the environment says; call before any JAX computation.

    env: the environment to read (default `os.environ`). The Neuron variables are exported to
      `os.environ` in every case (the backend reads them there).
    coordinator/num_processes/process_id: explicit values (override any detection).
    neuron: force Neuron on/off (default: `on_neuron()`).
    initialization_timeout: how long the ranks wait for each other at start-up (default
      `startup_timeout(env)`): the handshake of `trn_accum.cluster.agreement`, then
      `jax.distributed.initialize`; on Neuron in a Kubernetes pod also the wait for the root
      pod's name to resolve.
    heartbeat_timeout_seconds: passed to `jax.distributed.initialize` (a dead peer makes
      every other process exit after it; JAX's default is 100 s).

    Single process: starts nothing. Otherwise every rank first shows rank 0 its process count
    (`trn_accum.cluster.agreement`, within `initialization_timeout`; a rank that failed at
    start-up reports it there instead, `fail_startup`). Slurm: `jax.distributed.initialize`
    detects the step itself from `os.environ` (the plan must agree: checked after start-up with
    `jax.process_index()` and `jax.process_count()`).
    Kubernetes / explicit: the plan's values, with JAX's cluster detection off.
    Idempotent: a second call returns the same info.
    Starts the JAX backend only in a Slurm step (to read the process index JAX detected).
    """
    env = os.environ if env is None else env
    if initialization_timeout is None:
        initialization_timeout = startup_timeout(env)
    if neuron is None:
        neuron = on_neuron()
    plan = derive_launch(
        env,
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        neuron=neuron,
        resolve=rootport.launch_resolver(env, initialization_timeout),
    )
    import jax  # JAX only when actually starting

    if neuron:
        platform.apply_env(plan.neuron_env)  # values already in os.environ win
        applied = platform.apply_env(platform.trn2_env())  # what launch/env/trn2.sh exports
        if "JAX_COMPILATION_CACHE_DIR" in applied:  # JAX read its env when it was imported
            jax.config.update("jax_compilation_cache_dir", applied["JAX_COMPILATION_CACHE_DIR"])
        platform.configure_prng("neuron")  # rbg
    info = ProcessInfo(
        plan.mode, plan.process_id, plan.num_processes, plan.coordinator, bool(neuron), plan
    )
    if not plan.distributed or jax.distributed.is_initialized():
        return info
    kwargs: dict = {"initialization_timeout": int(initialization_timeout)}
    if heartbeat_timeout_seconds is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_seconds)
    # the coordinator's count rules in JAX: compare every rank's first (agreement.py)
    claim = agreement.Claim(plan.process_id, plan.num_processes, plan.num_processes_from)
    failed = None  # gloo's own-address lookup, which would fail in JAX with a C++ enforce
    if gloo_in_use(jax.config.jax_platforms, jax.config.jax_cpu_collectives_implementation):
        failed = gloo_address_problem(socket.gethostname())
    problem = agreement.check_count(
        claim, str(plan.coordinator), initialization_timeout, failed=failed
    )
    if problem is not None:
        raise LaunchError(problem)
    if plan.mode == "slurm":
        jax.distributed.initialize(cluster_detection_method="slurm", **kwargs)
        got = (jax.process_index(), jax.process_count())  # starts the backend
        if got != (plan.process_id, plan.num_processes):
            raise LaunchError(
                f"JAX's Slurm detection gave process {got[0]} of {got[1]} but the environment "
                f"says {plan.process_id} of {plan.num_processes}: check SLURM_PROCID/SLURM_NTASKS"
            )
    else:
        jax.distributed.initialize(
            plan.coordinator,
            plan.num_processes,
            plan.process_id,
            cluster_detection_method="deactivate",
            **kwargs,
        )
    return info
