"""The Neuron runtime's root address: a host resolved to an IPv4 address, a port reserved.

``NEURON_RT_ROOT_COMM_ID`` is documented as ``<ip_address:port>``, "mandatory for applications
that run workloads containing Collective Communication operators" (the NeuronX Runtime
developer guide, https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/guides/
nrt-developer-guide.html; source aws-neuron/aws-neuron-sdk neuron-runtime/guides/
nrt-developer-guide.rst:1062), so `trn_accum.cluster.distributed` resolves the root host on
each rank as it starts (`resolve_ipv4`; in a Kubernetes pod it waits up to the initialization
timeout, since a pod's DNS name appears only once the pod has an address).

The root port listens on rank 0's host. Inside the ephemeral range (Linux default 32768-60999,
``net.ipv4.ip_local_port_range``) any outgoing connection may take it first; the kernel's
``net.ipv4.ip_local_reserved_ports`` (a comma-separated list of ports and ``lo-hi`` ranges,
Linux Documentation/networking/ip-sysctl.rst) keeps it out of that draw: the Neuron
troubleshooting answer to "Multiworker execution hangs during NCCL init" is to reserve the
port of NEURON_RT_ROOT_COMM_ID so (aws-neuron/aws-neuron-sdk archive/nxd-training/
training-troubleshooting.rst:318), and AWS's samples do (aws-neuron/aws-neuron-eks-samples,
llama3.1_8B_finetune_ray_ptl_neuron/llama3_finetune/tp_zero1_llama3_8b_hf_finetune_ptl.sh:53).
`port_reserved` reads that list; `port_bind_error` is the bind test `neuron-check` runs.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Mapping

__all__ = [
    "RESERVED_PORTS_FILE",
    "launch_resolver",
    "parse_port_list",
    "port_bind_error",
    "port_reserved",
    "resolve_ipv4",
    "resolve_waiting",
    "root_comm_id",
    "split_address",
]

RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"


def resolve_ipv4(host: str) -> str:
    """`host`'s first IPv4 address ("localhost" -> "127.0.0.1"; an IPv4 literal is itself).
    Raises OSError (socket.gaierror) when it does not resolve."""
    infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"no IPv4 address for {host!r}")
    return str(infos[0][4][0])


def resolve_waiting(
    host: str,
    timeout_s: float,
    *,
    resolve: Callable[[str], str] | None = None,
    poll_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """`resolve(host)` (default `resolve_ipv4`), retried every `poll_s` until `timeout_s` has
    passed; the last OSError is raised then. `timeout_s` 0: one attempt."""
    deadline = clock() + max(0.0, timeout_s)
    while True:
        try:
            return (resolve or resolve_ipv4)(host)
        except OSError:
            if clock() + poll_s > deadline:
                raise
            sleep(poll_s)


def launch_resolver(env: Mapping[str, str], timeout_s: float) -> Callable[[str], str]:
    """The resolver a starting rank uses: in a Kubernetes pod (JOB_COMPLETION_INDEX set) it
    waits up to `timeout_s` for the root pod's name (it appears once that pod has an address);
    elsewhere (a Slurm node's name resolves or never will) one attempt."""
    wait = timeout_s if env.get("JOB_COMPLETION_INDEX") is not None else 0.0
    return functools.partial(resolve_waiting, timeout_s=wait)


def root_comm_id(host: str, port: int, resolve: Callable[[str], str] | None = None) -> str:
    """NEURON_RT_ROOT_COMM_ID for a root on `host`: "<ip>:<port>", `resolve` (default
    `resolve_ipv4`) giving the IP; a one-line ValueError naming the host when it fails."""
    try:
        return f"{(resolve or resolve_ipv4)(host)}:{port}"
    except OSError as e:
        raise ValueError(
            f"NEURON_RT_ROOT_COMM_ID: the root host {host!r} (process 0's) does not resolve to "
            f"an IPv4 address ({e.strerror or e}); the Neuron runtime wants <ip>:<port>: fix its "
            f"DNS or /etc/hosts entry, or set NEURON_RT_ROOT_COMM_ID=<ip of {host}>:{port}"
        ) from None


def split_address(text: str) -> tuple[str, int]:
    """ "host:port" -> (host, port); ValueError naming the text unless the port is 1-65535."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port (port 1-65535), e.g. 10.0.0.1:41000")
    return host, int(port)


def parse_port_list(text: str) -> list[tuple[int, int]]:
    """The kernel's port list ("41000,50000-50010", "" = none) as inclusive (lo, hi) ranges;
    ValueError naming the text when an item is not a port or a lo-hi range."""
    ranges = []
    for item in str(text).strip().split(","):
        item = item.strip()
        if not item:
            continue
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"port list {text!r}: {item!r} is not a port or a lo-hi range")
        ranges.append((int(lo), int(hi or lo)))
    return ranges


def port_reserved(port: int, text: str) -> bool:
    """Whether `port` is in the port list `text` (the content of RESERVED_PORTS_FILE)."""
    return any(lo <= port <= hi for lo, hi in parse_port_list(text))


def port_bind_error(port: int, host: str = "") -> str | None:
    """None when a TCP socket can bind `port` on `host` ("" = every address) now, else the
    reason (e.g. "Address already in use"). The socket is closed at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None
