"""`neuron-check` rows that only the node can prove, as small pure plans the tests check on CPU.

root          the Neuron runtime's root address (NEURON_RT_ROOT_COMM_ID): the host resolves
              to an IPv4 address, the port is free on the root's host (a bind test, run
              before the backend starts) and reserved from the ephemeral range
              (net.ipv4.ip_local_reserved_ports lists it; see trn_accum.cluster.rootport)
kernel-pair   the NKI forward + backward flash-attention kernels at the job's per-device
              shape (its S, heads, batch and LNC), and, at LNC=2, an odd per-device B x KV
              when the heads give one: the backward splits B x KV samples over the two
              cores (aws-neuron/nki-library 2.29, src/nkilib_src/nkilib/core/attention/
              attention_bwd.py:1139 `shard_size = div_ceil(bs * nheads_kv, num_shards)`),
              so an odd count leaves one core a sample short, a case nkilib's own tests
              run at LNC=1 only
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from trn_accum.cluster import rootport
from trn_accum.cluster.launch_plan import derive_launch
from trn_accum.model import attention as attn_lib
from trn_accum.neuron import kernels, platform

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
RTOL = 2e-5  # float32 programs computed two ways
RTOL_BF16 = 2e-2  # bf16 programs (the remat row, the kernel pair in bf16)


# ----------------------------------------------------------------------------- root


def root_target(env: Mapping[str, str]) -> tuple[str, int, bool]:
    """(host, port, this process is the root) of the runtime's root communicator: the value
    `distributed.initialize` exported, else what it would derive (the host unresolved)."""
    plan = derive_launch(env, neuron=True, resolve=lambda host: host)  # a preset value wins
    host, port = rootport.split_address(plan.neuron_env["NEURON_RT_ROOT_COMM_ID"])
    return host, port, plan.process_id == 0


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def row_root(
    env: Mapping[str, str],
    *,
    on_neuron: bool,
    resolve: Callable[[str], str] | None = None,
    bind: Callable[[int], str | None] = rootport.port_bind_error,
    read: Callable[[str], str | None] = _read,
) -> tuple[str, str]:
    """The root address resolves, its port binds on the root's host, and it is reserved.
    Off Neuron an unreserved port is reported, not failed (no runtime will listen there)."""
    host, port, is_root = root_target(env)
    try:
        address = rootport.root_comm_id(host, port, resolve)
    except ValueError as e:
        return FAIL, str(e)
    seen = [f"{host}:{port} -> {address}"]
    error = bind(port) if is_root else None
    if error is not None:
        msg = (
            f"port {port} cannot be bound on this host, the root's ({error}): stop what holds "
            f"it, or set TRN_ACCUM_NEURON_ROOT_PORT to a free port"
        )
        if on_neuron:
            return FAIL, f"{seen[0]}; {msg}"
        seen.append(msg + " (not Neuron: reported only)")
    elif is_root:
        seen.append(f"port {port} free here (bind test)")
    else:
        seen.append("not the root's host: bind not tested")
    text = read(rootport.RESERVED_PORTS_FILE)
    if text is None:
        seen.append(f"{rootport.RESERVED_PORTS_FILE} unreadable: reservation unknown")
    elif rootport.port_reserved(port, text):
        seen.append(f"reserved ({rootport.RESERVED_PORTS_FILE}: {text.strip()})")
    else:
        fix = ",".join(x for x in (text.strip(), str(port)) if x)
        msg = (
            f"port {port} not in net.ipv4.ip_local_reserved_ports ({text.strip() or 'empty'}): "
            f"an outgoing connection may take it first; as root: sysctl -w "
            f"net.ipv4.ip_local_reserved_ports={fix} (the Slurm script and the EKS pods do)"
        )
        if on_neuron:
            return FAIL, "; ".join([*seen, msg])
        seen.append(msg + " (not Neuron: reported only)")
    return PASS, "; ".join(seen)


# ----------------------------------------------------------------------------- kernel pair


@dataclasses.dataclass(frozen=True)
class PairShape:
    """One device's attention call: q [batch, seq, heads, head_dim], k/v [.., kv_heads, ..]."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    why: str

    @property
    def bkv(self) -> int:
        return self.batch * self.kv_heads

    def label(self) -> str:
        return (
            f"B={self.batch} H={self.heads} KV={self.kv_heads} S={self.seq} "
            f"Dh={self.head_dim} (B*KV={self.bkv} backward samples, B*H={self.batch * self.heads}"
            f" forward batch; {self.why})"
        )


def per_device_batch(global_batch: int, accum_steps: int | str, batch_shards: int) -> int:
    """Sequences per device in one minibatch (1 when accum_steps is "auto" or it rounds to 0)."""
    if not isinstance(accum_steps, int) or accum_steps < 1:
        return 1
    return max(1, global_batch // (accum_steps * max(1, batch_shards)))


def kernel_pair_plan(
    *,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    model_axis: int,
    batch: int,
    lnc: int,
) -> list[PairShape]:
    """The shapes the kernel-pair row runs: the job's per-device shape (heads split over the
    model axis, `batch` sequences), and at LNC=2 an odd B x KV when the job's is even but the
    per-device KV heads are odd (B=1 gives it). KV even: no odd B x KV exists."""
    heads_dev, kv_dev = heads // model_axis, kv_heads // model_axis
    job = PairShape(batch, heads_dev, kv_dev, seq, head_dim, "the job's per-device shape")
    if lnc != 2:
        return [job]
    if job.bkv % 2:
        return [dataclasses.replace(job, why=f"{job.why}, odd B*KV at LNC=2")]
    if kv_dev % 2:
        return [job, dataclasses.replace(job, batch=1, why="odd B*KV at LNC=2")]
    return [job]


def job_pair_plan(cfg, job_devices: int, lnc: int) -> list[PairShape]:
    """`kernel_pair_plan` for a Config on `job_devices` devices (the mesh rule of the probe:
    the config's model axis when it divides the devices, else 1)."""
    m = cfg.model
    model_axis = cfg.mesh.model if cfg.mesh.model > 0 and job_devices % cfg.mesh.model == 0 else 1
    if m.num_kv_heads % model_axis or m.num_heads % model_axis:
        model_axis = 1
    batch = per_device_batch(
        cfg.data.global_batch, cfg.trainer.accum_steps, job_devices // model_axis
    )
    return kernel_pair_plan(
        seq=cfg.data.seq_len,
        heads=m.num_heads,
        kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        model_axis=model_axis,
        batch=batch,
        lnc=lnc,
    )


# ----------------------------------------------------------------------------- comparing


def out_and_grads(fn: Callable, q, k, v, ct):
    out, vjp = jax.vjp(fn, q, k, v)
    return [out, *vjp(ct)]


def max_rel(got, want) -> float:
    return max(
        float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
        for g, w in zip(got, want, strict=True)
    )


def blockwise_f32(q, k, v, block_size: int = 512):
    """The reference for a kernel in any dtype: blockwise attention in float32, cast back."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return attn_lib.blockwise_attention(*f32, block_size=block_size).astype(q.dtype)


def compare_attention(fn, ref, args, tol: float, what: str) -> tuple[str, str]:
    got = jax.jit(lambda *a: out_and_grads(fn, *a))(*args)
    want = jax.jit(lambda *a: out_and_grads(ref, *a))(*args)
    err = max_rel(got, want)
    status = PASS if err <= tol else FAIL
    return status, f"{what}: max relative error of output, dq, dk, dv {err:.2e} (limit {tol:g})"


def row_kernel_pair(c) -> tuple[str, str]:
    """The NKI pair (no stand-ins) against blockwise attention at `job_pair_plan`'s
    shapes, in the config's compute dtype, on one device. `c`: a `neuron_check.Check`."""
    lnc = platform.lnc_setting()
    plan = job_pair_plan(c.cfg, len(c.job_devices), lnc)
    if not c.on_neuron:
        return SKIP, f"not Neuron; at LNC={lnc} it runs " + "; ".join(p.label() for p in plan)
    found = kernels.load_nki_attention_kernels()
    dtype = jnp.dtype(c.cfg.model.compute_dtype)
    tol = RTOL if dtype == jnp.float32 else RTOL_BF16
    seen = []
    for i, shape in enumerate(plan):
        ks = jax.random.split(jax.random.key(10 + i), 4)
        q_shape = (shape.batch, shape.seq, shape.heads, shape.head_dim)
        kv_shape = (shape.batch, shape.seq, shape.kv_heads, shape.head_dim)
        shapes = (q_shape, kv_shape, kv_shape, q_shape)  # q, k, v, the output's cotangent
        args = [jax.random.normal(kk, sh, dtype) for kk, sh in zip(ks, shapes, strict=True)]
        fn = functools.partial(
            kernels.nki_flash_attention, fwd=found["fwd"], bwd=found["bwd"], lnc=lnc
        )
        what = f"LNC={lnc} {shape.label()}"
        status, detail = compare_attention(fn, blockwise_f32, args, tol, what)
        seen.append(detail)
        if status == FAIL:
            return FAIL, "; ".join(seen)
    return PASS, "; ".join(seen)
