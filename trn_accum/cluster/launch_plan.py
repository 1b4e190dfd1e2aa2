"""What this process is in a job, derived from its environment alone (a pure function).

Where the process runs is read from its environment by a pure function,
``derive_launch(env) -> LaunchPlan``, checked in the first match of this order:

1. explicit: ``initialize(coordinator=..., num_processes=..., process_id=...)`` arguments, or the
   variables ``TRN_ACCUM_PROCESS_ID`` (+ ``TRN_ACCUM_NUM_PROCESSES``, ``TRN_ACCUM_COORDINATOR``
   = ``host:port``);
2. a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX`` is set): rank = ``JOB_COMPLETION_INDEX``,
   world size = ``TRN_ACCUM_NUM_PROCESSES``, coordinator = ``<job>-0.<subdomain>:<port>`` from
   ``TRN_ACCUM_JOB_NAME``, ``TRN_ACCUM_SUBDOMAIN`` (the headless Service) and
   ``TRN_ACCUM_COORDINATOR_PORT`` (default 55527); the manifest of ``trn_accum.eks`` sets them;
3. a Slurm job step (``srun``: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
   ``SLURM_PROCID``, ``SLURM_LOCALID``): the same values JAX's own Slurm detection computes
   (coordinator = first host of the step's node list, port ``SLURM_JOB_ID % 4096 + 61440``,
   ``JAX_COORDINATOR_PORT`` / ``JAX_COORDINATOR_ADDRESS`` override), and ``initialize`` lets
   JAX detect them itself. Inside a Slurm job but outside a step (the batch script) with more
   than one task is an error: run the trainer under ``srun``;
4. otherwise a single process (``jax.distributed`` is not started).

On Neuron the plan also holds, derived from the same facts, the multi-process variables the
Neuron PJRT plugin reads when its backend starts (Neuron docs, "JAX NeuronX" setup and the
Neuron runtime configuration page):
``NEURON_PJRT_PROCESSES_NUM_DEVICES`` ("64,64,..."; devices per process from
``TRN_ACCUM_DEVICES_PER_PROCESS``, else the count of ``NEURON_RT_VISIBLE_CORES``, else
128 / ``NEURON_LOGICAL_NC_CONFIG`` for a trn2.48xlarge), ``NEURON_PJRT_PROCESS_INDEX`` (the
rank) and ``NEURON_RT_ROOT_COMM_ID`` (``<ip>:<port>``, the runtime's documented form: process
0's host resolved on each rank by `trn_accum.cluster.rootport`, a one-line LaunchError naming it
where it does not resolve; the port ``TRN_ACCUM_NEURON_ROOT_PORT``, default 41000, outside JAX's
Slurm range 61440-65535; one process: ``127.0.0.1:<port>``, the runtime wants it for any
workload with collectives). A value already in the environment wins, as given.
`trn_accum.cluster.distributed.initialize` exports them and selects the rbg PRNG
(``jax_default_prng_impl``), since Threefry is not fully supported on Neuron.

Bad values raise ``LaunchError`` (a ``ValueError``) with one line naming the variable, the rule
and a fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from trn_accum.cluster import rootport
from trn_accum.cluster.launch_values import (
    RANGE,
    LaunchError,
    address_value,
    check_rank,
    expand_nodelist,
    int_value,
    port_value,
)
from trn_accum.neuron import platform

DEFAULT_K8S_PORT = 55527  # the port JAX's own Kubernetes detection uses


DEFAULT_NEURON_ROOT_PORT = 41000  # outside JAX's Slurm range [61440, 65535]


# a Slurm job step: what JAX's own Slurm detection requires
_SLURM_STEP_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What this process is in a multi-process job, derived from its environment alone.

    mode: "single" | "explicit" | "kubernetes" | "slurm".
    coordinator: "host:port" of process 0's coordination service (None when single).
    hosts: every process's host when the launcher says so (Slurm nodes, Kubernetes pod DNS
      names), else ().
    neuron_env: the Neuron launch variables to export before the backend starts (one process:
      only NEURON_RT_ROOT_COMM_ID, this host; empty off Neuron).
    num_processes_from: where num_processes was read (a variable or argument name).
    """

    mode: str
    num_processes: int
    process_id: int
    coordinator: str | None = None
    hosts: tuple[str, ...] = ()
    neuron_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    num_processes_from: str = "TRN_ACCUM_NUM_PROCESSES"

    @property
    def coordinator_host(self) -> str | None:
        return None if self.coordinator is None else self.coordinator.rsplit(":", 1)[0]

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1


def slurm_coordinator_port(env: Mapping[str, str]) -> int:
    """JAX's Slurm port: `JAX_COORDINATOR_PORT`, else SLURM_JOB_ID % 4096 + 61440."""
    if env.get("JAX_COORDINATOR_PORT"):
        return port_value(env, "JAX_COORDINATOR_PORT", 0)
    return int_value("SLURM_JOB_ID", env.get("SLURM_JOB_ID")) % 4096 + 61440


def _env_neuron(env: Mapping[str, str]) -> bool:
    return "neuron" in [p.strip() for p in env.get("JAX_PLATFORMS", "").lower().split(",")]


def _count_cores(spec: str) -> int:
    """Number of cores in NEURON_RT_VISIBLE_CORES ("0-63", "0,1,2", "0-31,64-95")."""
    n = 0
    for part in spec.split(","):
        r = RANGE.match(part.strip())
        if r is None or int(r.group(2) or r.group(1)) < int(r.group(1)):
            raise LaunchError(
                f"NEURON_RT_VISIBLE_CORES={spec!r} is not a core list like '0-63' or '0,1,2'"
            )
        n += int(r.group(2) or r.group(1)) - int(r.group(1)) + 1
    return n


def neuron_devices_per_process(env: Mapping[str, str]) -> int:
    """JAX devices each process drives on Neuron (64 on a trn2.48xlarge at LNC=2)."""
    if env.get("TRN_ACCUM_DEVICES_PER_PROCESS"):
        return int_value(
            "TRN_ACCUM_DEVICES_PER_PROCESS", env["TRN_ACCUM_DEVICES_PER_PROCESS"], minimum=1
        )
    if env.get("NEURON_RT_VISIBLE_CORES"):
        return _count_cores(env["NEURON_RT_VISIBLE_CORES"])
    try:
        lnc = platform.lnc_setting(env)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return platform.devices_per_node(lnc)


def _neuron_env(env: Mapping[str, str], plan: LaunchPlan, resolve) -> dict[str, str]:
    root_port = port_value(env, "TRN_ACCUM_NEURON_ROOT_PORT", DEFAULT_NEURON_ROOT_PORT)
    # The runtime guide (neuron-runtime/guides/nrt-developer-guide.rst:1062) calls it mandatory
    # with collectives: one process too (its cores' collectives; the root is this host).
    try:
        root = env.get("NEURON_RT_ROOT_COMM_ID") or (
            rootport.root_comm_id(str(plan.coordinator_host), root_port, resolve)
            if plan.distributed
            else f"127.0.0.1:{root_port}"
        )
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if not plan.distributed:
        return {"NEURON_RT_ROOT_COMM_ID": root}
    derived = {
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join(
            [str(neuron_devices_per_process(env))] * plan.num_processes
        ),
        "NEURON_PJRT_PROCESS_INDEX": str(plan.process_id),
    }
    return {**{k: env.get(k) or v for k, v in derived.items()}, "NEURON_RT_ROOT_COMM_ID": root}


def _explicit(env, coordinator, num_processes, process_id) -> LaunchPlan:
    num_name = "TRN_ACCUM_NUM_PROCESSES" if num_processes is None else "num_processes"
    num = int_value(
        num_name, env.get(num_name, "1") if num_processes is None else str(num_processes), minimum=1
    )
    pid_name = (
        "TRN_ACCUM_PROCESS_ID"
        if process_id is None and env.get("TRN_ACCUM_PROCESS_ID") is not None
        else "process_id"
    )
    pid = int_value(pid_name, env.get(pid_name) if process_id is None else str(process_id))
    check_rank(pid_name, pid, "num_processes", num)
    coord = coordinator if coordinator is not None else env.get("TRN_ACCUM_COORDINATOR")
    if num == 1:
        return LaunchPlan("single", 1, 0)
    if not coord:
        raise LaunchError(
            f"num_processes={num} needs a coordinator: set TRN_ACCUM_COORDINATOR=host:port "
            f"(process 0's host and a free port) or pass coordinator='host:port'"
        )
    return LaunchPlan(
        "explicit", num, pid, address_value("coordinator", coord), num_processes_from=num_name
    )


def _kubernetes(env: Mapping[str, str]) -> LaunchPlan:
    pid = int_value("JOB_COMPLETION_INDEX", env.get("JOB_COMPLETION_INDEX"))
    if not env.get("TRN_ACCUM_NUM_PROCESSES"):
        raise LaunchError(
            "JOB_COMPLETION_INDEX is set (Kubernetes Indexed Job) but TRN_ACCUM_NUM_PROCESSES is "
            "not: set it to the Job's completions (the node count), as `trn-accum render-eks` does"
        )
    num = int_value("TRN_ACCUM_NUM_PROCESSES", env["TRN_ACCUM_NUM_PROCESSES"], minimum=1)
    check_rank("JOB_COMPLETION_INDEX", pid, "TRN_ACCUM_NUM_PROCESSES", num)
    job, sub = env.get("TRN_ACCUM_JOB_NAME", ""), env.get("TRN_ACCUM_SUBDOMAIN", "")
    hosts: tuple[str, ...] = ()
    if env.get("TRN_ACCUM_COORDINATOR"):
        coord = address_value("TRN_ACCUM_COORDINATOR", env["TRN_ACCUM_COORDINATOR"])
    elif num == 1:
        coord = None
    else:
        if not job or not sub:
            missing = " and ".join(
                n for n, v in (("TRN_ACCUM_JOB_NAME", job), ("TRN_ACCUM_SUBDOMAIN", sub)) if not v
            )
            raise LaunchError(
                f"Kubernetes Indexed Job with {num} pods but {missing} not set: the coordinator "
                f"is <job>-0.<subdomain>:<port>; set them (the Job name and its headless "
                f"Service) or TRN_ACCUM_COORDINATOR=host:port"
            )
        port = port_value(env, "TRN_ACCUM_COORDINATOR_PORT", DEFAULT_K8S_PORT)
        hosts = tuple(f"{job}-{i}.{sub}" for i in range(num))
        coord = f"{hosts[0]}:{port}"
    if num == 1:
        return LaunchPlan("single", 1, 0, None, hosts)
    return LaunchPlan("kubernetes", num, pid, coord, hosts)


def _slurm(env: Mapping[str, str]) -> LaunchPlan:
    hosts = tuple(expand_nodelist(env["SLURM_STEP_NODELIST"]))
    num = int_value("SLURM_NTASKS", env["SLURM_NTASKS"], minimum=1)
    pid = int_value("SLURM_PROCID", env["SLURM_PROCID"])
    check_rank("SLURM_PROCID", pid, "SLURM_NTASKS", num)
    if num == 1:
        return LaunchPlan("single", 1, 0, None, hosts)
    if env.get("JAX_COORDINATOR_ADDRESS"):
        coord = address_value("JAX_COORDINATOR_ADDRESS", env["JAX_COORDINATOR_ADDRESS"])
    else:
        coord = f"{hosts[0]}:{slurm_coordinator_port(env)}"
    return LaunchPlan("slurm", num, pid, coord, hosts, num_processes_from="SLURM_NTASKS")


def derive_launch(
    env: Mapping[str, str],
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    neuron: bool | None = None,
    resolve: Callable[[str], str] | None = None,
) -> LaunchPlan:
    """The launch plan of this process: a function of `env` and the explicit arguments.

    `neuron`: whether the Neuron backend will run (None: `JAX_PLATFORMS` names "neuron").
    `resolve`: host -> IPv4 for NEURON_RT_ROOT_COMM_ID (default `rootport.resolve_ipv4`).
    Raises LaunchError (one line) on missing or inconsistent values.
    """
    if any(v is not None for v in (coordinator, num_processes, process_id)) or env.get(
        "TRN_ACCUM_PROCESS_ID"
    ):
        plan = _explicit(env, coordinator, num_processes, process_id)
    elif env.get("JOB_COMPLETION_INDEX") is not None:
        plan = _kubernetes(env)
    elif all(env.get(k) for k in _SLURM_STEP_VARS):
        plan = _slurm(env)
    elif env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS", "1").strip() not in ("", "1"):
        missing = ", ".join(k for k in _SLURM_STEP_VARS if not env.get(k))
        raise LaunchError(
            f"inside Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS={env['SLURM_NTASKS']} but "
            f"not in a job step (no {missing}): launch one process per task with "
            f"`srun trn-accum train ...`"
        )
    else:
        plan = LaunchPlan("single", 1, 0)
    if neuron is None:
        neuron = _env_neuron(env)
    if neuron:
        plan = dataclasses.replace(plan, neuron_env=_neuron_env(env, plan, resolve))
    return plan
