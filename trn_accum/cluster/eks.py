"""Kubernetes (EKS) manifests for training on N trn2.48xlarge nodes.

    trn-accum render-eks --nodes 4 --image IMAGE [--config FILE] [-o FILE]
    render_eks(4, "123456789012.dkr.ecr.us-west-2.amazonaws.com/trn-accum:neuron") -> YAML

Two documents, built-in kinds only (validated offline with `kubernetes-validate --strict`):

- a headless Service (`clusterIP: None`, `publishNotReadyAddresses: true`) that gives every pod
  the DNS name `<name>-<index>.<name>` before it is ready, so rank 0 (the jax.distributed
  coordinator and the Neuron root communicator) is reachable while everyone starts;
- an Indexed Job (`completionMode: Indexed`, `parallelism = completions = nodes`): one pod per
  node, rank = `JOB_COMPLETION_INDEX`, with `TRN_ACCUM_NUM_PROCESSES`, `TRN_ACCUM_JOB_NAME`,
  `TRN_ACCUM_SUBDOMAIN` and `TRN_ACCUM_COORDINATOR_PORT` for `trn_accum.distributed`.

All ranks restart together. A lone restarted pod cannot rejoin a running `jax.distributed` job,
so a failure must take every rank down and bring every rank back:
- when any rank dies, JAX's coordination service makes every other rank exit non-zero
  (heartbeat / lost coordinator; tested in tests/test_distributed.py), so every pod fails;
- `restartPolicy: Never` + the Job controller replaces each failed pod (same index, same
  hostname); `podReplacementPolicy: Failed` waits until the old pod is gone, so two pods never
  hold one rank; the new pods form a new job and resume from the newest checkpoint on the
  shared volume;
- `backoffLimit = nodes x max_restarts`: one incident fails up to `nodes` pods, so this allows
  `max_restarts` crash-restarts before the Job is marked failed;
- `podFailurePolicy`: exit 2 (a user error: bad config) fails the Job at once (retrying cannot
  help); exit 75 (preempted after a clean checkpoint save) and pods evicted or preempted by
  Kubernetes (`DisruptionTarget`) are ignored: replaced without counting against the limit.
`terminationGracePeriodSeconds` (default 120) is the time a SIGTERMed pod has to save.

Ports and interface. Both listening ports (the Neuron root 41000, the coordinator 55527) lie in
Linux's default ephemeral range 32768-60999, so the pod reserves them with the sysctl
``net.ipv4.ip_local_reserved_ports`` (pod ``securityContext.sysctls``). It is per network
namespace from kernel 3.16 (Linux commit 122ff243f5f1, "ipv4: make ip_local_reserved_ports per
netns"), so it changes this pod only (never with hostNetwork), and Kubernetes counts it among
the safe sysctls from 1.27 on kernel 3.16+ (https://kubernetes.io/docs/tasks/administer-cluster/
sysctl-cluster/); on an older cluster it is unsafe: the kubelet must allow it
(``--allowed-unsafe-sysctls=net.ipv4.ip_local_reserved_ports``) or the pod fails to start.
``CCOM_SOCKET_IFNAME`` (default ``eth0``, the pod's interface; `socket_ifname`) names the
interface the Neuron collectives' socket bootstrap uses, as AWS's EKS samples set it
(aws-neuron/aws-neuron-eks-samples, dp_bert_hf_pretrain/lib/trn1_dist_ddp.py:47,
llama3.1_8B_finetune_ray_ptl_neuron/llama3_finetune/ray_train_llama3.py:51).

A JobSet (`failurePolicy.maxRestarts`) would restart all child pods by itself, but it is a CRD
(the JobSet controller must be installed) and cannot be validated offline here.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from trn_accum.cluster.launch_plan import DEFAULT_K8S_PORT, DEFAULT_NEURON_ROOT_PORT
from trn_accum.errors import EXIT_PREEMPTED, EXIT_USAGE, UserError
from trn_accum.neuron.platform import TRN2_CHIPS_PER_NODE, TRN2_INSTANCE_TYPE

__all__ = [
    "DEFAULT_CONFIG",
    "RenderError",
    "manifests",
    "render_eks",
    "to_yaml",
]

DEFAULT_CONFIG = "configs/fuji-3b-trn2.toml"
DEFAULT_NAME = "fuji-3b"
DEFAULT_PVC = "trn-accum-fsx"
DEFAULT_WORKDIR = "/workspace/trn_accum"  # the repository inside the image (Dockerfile)
CHECKPOINT_MOUNT = "/checkpoints"
COORDINATOR_PORT = DEFAULT_K8S_PORT
NEURON_ROOT_PORT = DEFAULT_NEURON_ROOT_PORT
INSTANCE_TYPE = TRN2_INSTANCE_TYPE
NEURON_DEVICES = TRN2_CHIPS_PER_NODE  # aws.amazon.com/neuron counts chips
EFA_DEVICES = 16  # EFA interfaces of a trn2.48xlarge
SOCKET_IFNAME = "eth0"  # the pod's interface, CCOM_SOCKET_IFNAME in AWS's EKS samples
RESERVED_PORTS_SYSCTL = "net.ipv4.ip_local_reserved_ports"
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")  # a Linux interface name (IFNAMSIZ - 1)

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 label
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # RFC 1123 subdomain


class RenderError(UserError):
    """A bad render-eks value: one line naming the value, the rule and a fix."""


def _check(nodes, image, config, name, namespace, pvc, max_restarts, grace_seconds) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise RenderError(f"--nodes {nodes!r} must be an integer >= 1 (trn2.48xlarge nodes)")
    if not image or any(c.isspace() for c in image):
        raise RenderError(
            f"--image {image!r} must be a container image reference, e.g. "
            f"123456789012.dkr.ecr.us-west-2.amazonaws.com/trn-accum:neuron"
        )
    # pod hostnames are <name>-<index>: a DNS label of at most 63 characters
    if not _DNS_LABEL.match(name) or len(name) + 1 + len(str(nodes - 1)) > 63:
        raise RenderError(
            f"--name {name!r} must be a DNS label (lowercase letters, digits, '-', starting "
            f"with a letter) short enough for '{name}-{nodes - 1}' to fit 63 characters"
        )
    if not _DNS_LABEL.match(namespace):
        raise RenderError(f"--namespace {namespace!r} must be a DNS label, e.g. training")
    if not _DNS_SUBDOMAIN.match(pvc) or len(pvc) > 253:
        raise RenderError(f"--pvc {pvc!r} must be a PersistentVolumeClaim name, e.g. {DEFAULT_PVC}")
    if not config or any(c.isspace() for c in config):
        raise RenderError(f"--config {config!r} must be a config path inside the image")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise RenderError(f"--max-restarts {max_restarts!r} must be an integer >= 0")
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, int) or grace_seconds < 1:
        raise RenderError(f"grace_seconds={grace_seconds!r} must be an integer >= 1")
    return nodes


def manifests(
    nodes: int,
    image: str,
    config: str = DEFAULT_CONFIG,
    *,
    name: str = DEFAULT_NAME,
    namespace: str = "default",
    pvc: str = DEFAULT_PVC,
    run_dir: str | None = None,
    train_args: Sequence[str] = (),
    max_restarts: int = 3,
    scheduler_name: str | None = None,
    shm_size: str = "64Gi",
    grace_seconds: int = 120,
    workdir: str = DEFAULT_WORKDIR,
    neuron_check: bool = False,
    socket_ifname: str = SOCKET_IFNAME,
) -> list[dict[str, Any]]:
    """The Service and the Indexed Job as dicts (see `render_eks`)."""
    _check(nodes, image, config, name, namespace, pvc, max_restarts, grace_seconds)
    if not isinstance(socket_ifname, str) or not _IFNAME.match(socket_ifname):
        raise RenderError(
            f"--socket-ifname {socket_ifname!r} must be a network interface name (1-15 letters, "
            f"digits, '_.:-'), e.g. {SOCKET_IFNAME}, the pod's interface"
        )
    run_dir = run_dir or f"{CHECKPOINT_MOUNT}/{name}"
    labels = {
        "app.kubernetes.io/name": "trn-accum",
        "app.kubernetes.io/instance": name,
    }
    meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
    train = ["trn-accum", "train", "--config", config, "--run-dir", run_dir, *train_args]
    check = ["trn-accum", "neuron-check", "--config", config, "--run-dir", run_dir]
    script = (
        "set -euo pipefail\n"
        "source launch/env/trn2.sh\n"
        + (
            f"{' '.join(shlex.quote(a) for a in check)} || {{ echo 'neuron-check failed: "
            f"not training (a broken piece fails the Job, not retried)' >&2; "
            f"exit {EXIT_USAGE}; }}\n"
            if neuron_check
            else ""
        )
        + f"exec {' '.join(shlex.quote(a) for a in train)}\n"
    )
    env = [
        {"name": "TRN_ACCUM_NUM_PROCESSES", "value": str(nodes)},
        {"name": "TRN_ACCUM_JOB_NAME", "value": name},
        {"name": "TRN_ACCUM_SUBDOMAIN", "value": name},
        {"name": "TRN_ACCUM_COORDINATOR_PORT", "value": str(COORDINATOR_PORT)},
        {"name": "TRN_ACCUM_NEURON_ROOT_PORT", "value": str(NEURON_ROOT_PORT)},
        {"name": "TRN_ACCUM_SHARED_DIR", "value": CHECKPOINT_MOUNT},  # compile caches
        {"name": "CCOM_SOCKET_IFNAME", "value": socket_ifname},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    devices = {
        "aws.amazon.com/neuron": NEURON_DEVICES,
        "vpc.amazonaws.com/efa": EFA_DEVICES,
    }
    pod_spec: dict[str, Any] = {
        "subdomain": name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace_seconds,
        "nodeSelector": {"node.kubernetes.io/instance-type": INSTANCE_TYPE},
        "tolerations": [
            {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}
        ],
        # The listening ports out of the ephemeral range, in this pod's network namespace only
        # (a safe sysctl from Kubernetes 1.27 on kernel 3.16+; older: the kubelet must allow it
        # with --allowed-unsafe-sysctls, see the module docstring).
        "securityContext": {
            "sysctls": [{"name": RESERVED_PORTS_SYSCTL, "value": reserved_ports_value()}]
        },
        "containers": [
            {
                "name": "train",
                "image": image,
                "workingDir": workdir,
                "command": ["bash", "-c", script],
                "env": env,
                "ports": [
                    {"name": "coordinator", "containerPort": COORDINATOR_PORT},
                    {"name": "neuron-root", "containerPort": NEURON_ROOT_PORT},
                ],
                "resources": {"requests": dict(devices), "limits": dict(devices)},
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
                ],
            }
        ],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc}},
        ],
    }
    if scheduler_name:
        pod_spec["schedulerName"] = scheduler_name
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": dict(labels),
            "ports": [
                {"name": "coordinator", "port": COORDINATOR_PORT, "targetPort": COORDINATOR_PORT},
                {"name": "neuron-root", "port": NEURON_ROOT_PORT, "targetPort": NEURON_ROOT_PORT},
            ],
        },
    }

    def exit_codes(action: str, code: int) -> dict:
        return {
            "action": action,
            "onExitCodes": {"containerName": "train", "operator": "In", "values": [code]},
        }

    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": nodes * max_restarts,
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    exit_codes("FailJob", EXIT_USAGE),
                    exit_codes("Ignore", EXIT_PREEMPTED),
                    {
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                ]
            },
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }
    return [service, job]


def reserved_ports_value() -> str:
    """The pods' net.ipv4.ip_local_reserved_ports: the Neuron root and coordinator ports."""
    return ",".join(str(p) for p in sorted({NEURON_ROOT_PORT, COORDINATOR_PORT}))


# ----------------------------------------------------------------------------- YAML


class _Dumper(yaml.SafeDumper):
    """pyyaml's safe dumper, with multi-line strings (the pod script) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: Sequence[dict], header: str = "") -> str:
    """Multi-document YAML (block style, keys in the order given) with `header` as comments."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, explicit_start=True
    )
    return head + body


def render_eks(nodes: int, image: str, config: str = DEFAULT_CONFIG, **options: Any) -> str:
    """Multi-document YAML: the headless Service and the Indexed Job for `nodes` trn2 nodes.

    nodes: trn2.48xlarge nodes = pods = jax.distributed processes (64 devices each).
    image: the `neuron` stage of the Dockerfile, pushed to a registry the cluster can pull from.
    config: a config path inside the image (relative to `workdir`, the repository).
    options: those of `manifests`: name (Job and Service name; pod DNS names
      `<name>-<i>.<name>`), namespace, pvc (a PersistentVolumeClaim on a shared file system,
      e.g. FSx for Lustre, ReadWriteMany, mounted at /checkpoints on every pod: checkpoints,
      metrics and compile caches), run_dir (default /checkpoints/<name>; a re-applied Job
      resumes from its newest checkpoint), train_args (extra `trn-accum train` arguments, e.g.
      ("--set", "trainer.accum_steps=8")), max_restarts (whole-job restarts after crashes:
      backoffLimit = nodes x max_restarts), scheduler_name (e.g. the Neuron scheduler
      extension's, if installed as a separate scheduler), shm_size, grace_seconds, workdir,
      neuron_check (every pod runs `trn-accum neuron-check` before training; a failing row
      fails the Job with exit 2 in minutes, before a long compile), socket_ifname
      (CCOM_SOCKET_IFNAME, default eth0).
    """
    docs = manifests(nodes, image, config, **options)
    name = options.get("name", DEFAULT_NAME)
    namespace = options.get("namespace", "default")
    pvc = options.get("pvc", DEFAULT_PVC)
    run_dir = options.get("run_dir")
    train_args = options.get("train_args", ())
    max_restarts = options.get("max_restarts", 3)
    scheduler_name = options.get("scheduler_name")
    socket_ifname = options.get("socket_ifname", SOCKET_IFNAME)
    cmd = ["trn-accum", "render-eks", "--nodes", str(nodes), "--image", image]
    if options.get("neuron_check"):
        cmd.append("--neuron-check")
    if config != DEFAULT_CONFIG:
        cmd += ["--config", config]
    for flag, value, default in (
        ("--name", name, DEFAULT_NAME),
        ("--namespace", namespace, "default"),
        ("--pvc", pvc, DEFAULT_PVC),
        ("--run-dir", run_dir, None),
        ("--max-restarts", max_restarts, 3),
        ("--scheduler-name", scheduler_name, None),
        ("--socket-ifname", socket_ifname, SOCKET_IFNAME),
    ):
        if value != default:
            cmd += [flag, str(value)]
    rest = list(train_args)
    while rest:
        a = rest.pop(0)
        if a == "--set" and rest:
            cmd += ["--set", rest.pop(0)]
        else:
            cmd.append(f"--train-arg={a}")
    header = (
        f"Fuji training on {nodes} x {INSTANCE_TYPE} (trn_accum). Generated by:\n"
        f"  {' '.join(shlex.quote(c) for c in cmd)}\n"
        f"Apply: kubectl apply -f FILE; logs: kubectl logs -f job/{name} (rank 0), or\n"
        f"  kubectl logs -l app.kubernetes.io/instance={name} --prefix -f (all ranks).\n"
        f"The pods set the sysctl {RESERVED_PORTS_SYSCTL}={reserved_ports_value()}: safe from\n"
        f"  Kubernetes 1.27 on kernel 3.16+; older clusters: kubelet\n"
        f"  --allowed-unsafe-sysctls={RESERVED_PORTS_SYSCTL}, or the pods fail to start."
    )
    return to_yaml(docs, header)
