"""`trn-accum neuron-check`: prove each risky piece of a trn2 run on the first node, in minutes.

Each row compiles and runs one small program on this process's devices and compares it with
its reference (the same program another way, on the same devices, or exact arithmetic):

    root          the runtime's root address resolves, its port is free (bind test) and
                  reserved from the ephemeral range (run first, before the backend starts)
    platform      the JAX backend and its device count (64 per trn2.48xlarge at LNC=2)
    lnc           compiler and runtime logical-core size agree, and the runtime's device count
                  is what that size gives
    prng          the PRNG in use (rbg on Neuron), a jitted draw equal to an eager one
    psum          an all-device psum equal to its exact integer sum
    psum-procs    the same across processes (multi-process jobs only)
    accumulate    the real train step (the config's model pieces, reduced size) at k=4 equal to
                  k=1: loss and gradient norm
    reduce-once   reduce="once" equal to "per_minibatch"
    gather-once   trainer.gather = "once_unsharded" equal to "per_minibatch" (under "once")
    blockwise     blockwise attention equal to plain (output and gradients)
    neuron-flash  neuron_flash equal to blockwise (the NKI kernels where importable, else the
                  CPU stand-ins, marked so), in float32 and in a sharp bf16 case that an
                  NKI Library before 2.30 fails (its attention_bwd scaled Q in bf16)
    kernel-pair   the NKI kernels at the job's per-device shape and LNC, an odd B x KV at LNC=2
                  included when the heads give one (trn2 only: off Neuron it is skipped and
                  names the shapes it would run; trn_accum/plan/node_rows.py)
    remat         a remat'ed bf16 layer equal to the plain one (the preflight warns that remat can
                  emit reduce-precision, which Neuron lists unsupported: this row proves it runs)
    checkpoint    a save and restore on the run directory's filesystem, bit-exact
    cache         the compile-cache directories writable

Exit 0 only if every applicable row passes; a failing row names the piece and what it saw.
Off-Neuron the same rows run on emulated CPU devices with the stand-ins marked; the test suite
runs it there.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.errors import EXIT_FAILED, EXIT_OK
from trn_accum.model import attention as attn_lib
from trn_accum.model import fuji
from trn_accum.neuron import kernels, platform
from trn_accum.plan import node_rows
from trn_accum.plan.node_rows import FAIL, PASS, RTOL, RTOL_BF16, SKIP, compare_attention, max_rel
from trn_accum.train.checkpoint import Checkpointer
from trn_accum.train.config import Config, TrainerConfig, load_config


@dataclasses.dataclass
class Row:
    piece: str
    status: str
    detail: str
    seconds: float = 0.0


class Check:
    """What the rows share: the config, the devices and the probe model derived from them."""

    def __init__(self, cfg: Config, run_dir: str):
        self.cfg, self.run_dir = cfg, run_dir
        self.devices = jax.local_devices()  # this process's (64 per trn2.48xlarge)
        self.job_devices = jax.devices()  # every process's: the train-step rows use them all
        self.on_neuron = jax.default_backend() == "neuron"

    # -------------------------------------------------------------------- the probe config

    def probe(self, *, data: int = 1, **trainer) -> Config:
        """The config's model pieces (attention, remat, head_dim, GQA ratio, mesh rules) at a
        size that compiles in seconds, float32, on a mesh over the job's devices (every
        process's, so a multi-node check runs the real cross-node step): the config's model
        axis, `data` (when it divides) and fsdp the rest."""
        c, n = self.cfg, len(self.job_devices)
        model_axis = c.mesh.model if c.mesh.model > 0 and n % c.mesh.model == 0 else 1
        data = data if (n // model_axis) % data == 0 else 1
        fsdp = n // model_axis // data
        group = max(1, c.model.num_heads // max(1, c.model.num_kv_heads))
        seq = 256
        m = dataclasses.replace(
            c.model,
            vocab_size=1024,
            num_layers=2,
            hidden_dim=256,
            num_kv_heads=model_axis,
            num_heads=model_axis * group,
            ffn_dim=512,
            max_seq_len=seq,
            compute_dtype="float32",
            layer_loop="scan",
            attention_block=min(c.model.attention_block, 128),
            loss_chunk=min(c.model.loss_chunk, seq) if c.model.loss_chunk else 0,
        )
        mesh = dataclasses.replace(c.mesh, data=data, fsdp=fsdp, model=model_axis, nodes=1)
        shards = n // model_axis
        data_cfg = dataclasses.replace(
            c.data, kind="synthetic", seq_len=seq, global_batch=shards * 4, path=""
        )
        # the options a row compares are reset to their defaults (a row names the ones it
        # tests), the rest kept
        defaults = TrainerConfig()
        base = {
            k: getattr(defaults, k) for k in ("accum_steps", "reduce", "gather", "reduce_dtype")
        }
        t = dataclasses.replace(c.trainer, **{**base, **trainer})
        return dataclasses.replace(c, model=m, mesh=mesh, data=data_cfg, trainer=t)

    def train_step(self, cfg: Config) -> dict:
        """One real train step of `cfg` from its initial state: the metrics as floats."""
        from trn_accum.train.loop import Trainer

        trainer = Trainer.build(cfg, self.job_devices)
        _, metrics = trainer.step(trainer.init(), trainer.batch(0))
        return {k: float(v) for k, v in jax.device_get(metrics).items()}


# ---------------------------------------------------------------------------- the rows


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


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


def _compare_steps(
    c: Check, name_a: str, a: Config, name_b: str, b: Config, rtol: float = RTOL
) -> tuple[str, str]:
    ma, mb = c.train_step(a), c.train_step(b)
    keys = ("loss", "grad_norm")
    ok = all(_close(ma[k], mb[k], rtol) for k in keys)
    detail = "; ".join(f"{k} {ma[k]:.7g} ({name_a}) vs {mb[k]:.7g} ({name_b})" for k in keys)
    return (PASS if ok else FAIL), detail


def row_accumulate(c: Check) -> tuple[str, str]:
    return _compare_steps(c, "k=4", c.probe(accum_steps=4), "k=1", c.probe(accum_steps=1))


def row_reduce_once(c: Check) -> tuple[str, str]:
    """On a mesh with data=2 (on one node the config's data axis is 1, where "once" has nothing
    to reduce and runs the per_minibatch program): the shard_map path and its one psum, in the
    config's trainer.reduce_dtype (bfloat16: compared at bf16 rounding)."""
    dtype = c.cfg.trainer.reduce_dtype
    once = c.probe(data=2, accum_steps=4, reduce="once", reduce_dtype=dtype)
    status, detail = _compare_steps(
        c, "once" if dtype == "float32" else f"once, {dtype}", once,
        "per_minibatch", c.probe(data=2, accum_steps=4),
        RTOL if dtype == "float32" else RTOL_BF16,
    )  # fmt: skip
    return (
        status,
        f"{detail}; mesh data {once.mesh.data} x fsdp {once.mesh.fsdp} x model {once.mesh.model}",
    )


def row_gather_once(c: Check) -> tuple[str, str]:
    """trainer.gather = "once_unsharded" (the FSDP weights gathered once, bf16 on the wire in
    the trainer; float32 here) equal to "per_minibatch", both under reduce="once"."""
    kw = dict(data=2, accum_steps=4, reduce="once")
    return _compare_steps(
        c, "gather once_unsharded", c.probe(**kw, gather="once_unsharded"),
        "per_minibatch", c.probe(**kw),
    )  # fmt: skip


def _attention_inputs(c: Check, seq: int = 256):
    m = c.probe().model
    ks = jax.random.split(jax.random.key(1), 4)
    shape_q = (2, seq, m.num_heads, m.head_dim)
    shape_kv = (2, seq, m.num_kv_heads, m.head_dim)
    q = jax.random.normal(ks[0], shape_q, jnp.float32)
    k, v = (jax.random.normal(kk, shape_kv, jnp.float32) for kk in ks[1:3])
    ct = jax.random.normal(ks[3], shape_q, jnp.float32)
    return (q, k, v, ct), m.attention_block


def row_blockwise(c: Check) -> tuple[str, str]:
    args, block = _attention_inputs(c)
    fn = functools.partial(attn_lib.blockwise_attention, block_size=block)
    return compare_attention(
        fn, attn_lib.plain_attention, args, RTOL, f"blockwise (block {block}) vs plain"
    )


def row_neuron_flash(c: Check) -> tuple[str, str]:
    args, block = _attention_inputs(c)
    try:
        found = kernels.active_kernels()
        label = "substituted kernels" if kernels.substituted() else "NKI Library kernels"
    except ValueError as e:
        if c.on_neuron:
            return FAIL, str(e)
        found, label = kernels.reference_kernels(), "CPU stand-in kernels"
    fn = functools.partial(kernels.flash_attention, kernels=found)
    ref = functools.partial(attn_lib.blockwise_attention, block_size=block)
    status, f32 = compare_attention(fn, ref, args, RTOL, f"neuron_flash ({label}) vs blockwise")
    if status == FAIL:
        return status, f32
    one = functools.partial(kernels.nki_flash_attention, fwd=found["fwd"], bwd=found["bwd"])
    sharp_args = _sharp_bf16_inputs()
    status, sharp = compare_attention(one, node_rows.blockwise_f32, sharp_args, RTOL_BF16, SHARP)
    return status, f"{f32}; {sharp}"


# Head dim 96 (scale 96**-0.5, not a power of two) and q, k of std 6 (scores of std 36): the
# nkilib 2.29 backward rounded Q * scale to bf16 and misses by 1.04e-1 here; 2.30+ scales the
# float32 scores: 6.2e-3 through the stand-ins (kernel_refs; tests/test_neuron_check.py).
SHARP = "bf16, head dim 96, sharp softmax (nkilib 2.30+ numerics)"


def _sharp_bf16_inputs():
    """q [1, 256, 2, 96], k/v [1, 256, 1, 96] and the output's cotangent, bfloat16."""
    ks = jax.random.split(jax.random.key(5), 4)
    shapes = [(1, 256, 2, 96), (1, 256, 1, 96), (1, 256, 1, 96), (1, 256, 2, 96)]
    sd = (6.0, 6.0, 1.0, 1.0)
    return [
        (jax.random.normal(kk, sh) * f).astype(jnp.bfloat16)
        for kk, sh, f in zip(ks, shapes, sd, strict=True)
    ]


def row_remat(c: Check) -> tuple[str, str]:
    m = dataclasses.replace(c.probe().model, compute_dtype="bfloat16", num_layers=1)
    policy = c.cfg.model.remat if c.cfg.model.remat != "none" else "full"
    params = fuji.init_params(m, jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (2, 128), 0, m.vocab_size)
    batch = {"input_ids": tokens, "target_labels": tokens, "target_mask": jnp.ones_like(tokens)}

    def grads(model):
        def loss(p):
            return fuji.loss_fn(p, batch, model)[0]

        return jax.jit(jax.grad(loss))(params)

    got = jax.tree.leaves(grads(dataclasses.replace(m, remat=policy)))
    want = jax.tree.leaves(grads(dataclasses.replace(m, remat="none")))
    err = max_rel(got, want)
    status = PASS if err <= RTOL_BF16 else FAIL
    return (
        status,
        f"remat {policy!r}, bf16: max relative gradient error vs no remat {err:.2e} "
        f"(limit {RTOL_BF16:g})",
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


ROWS: tuple[tuple[str, Callable[[Check], tuple[str, str]]], ...] = (
    ("platform", row_platform),
    ("lnc", row_lnc),
    ("prng", row_prng),
    ("psum", row_psum),
    ("psum-procs", row_psum_procs),
    ("accumulate", row_accumulate),
    ("reduce-once", row_reduce_once),
    ("gather-once", row_gather_once),
    ("blockwise", row_blockwise),
    ("neuron-flash", row_neuron_flash),
    ("kernel-pair", node_rows.row_kernel_pair),
    ("remat", row_remat),
    ("checkpoint", row_checkpoint),
    ("cache", row_cache),
)


# ---------------------------------------------------------------------------- running


def _row(piece: str, fn: Callable[[], tuple[str, str]]) -> Row:
    """fn() as a timed Row; a row that raises fails with its one-line cause."""
    t = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as e:  # the row's piece is broken: name it, keep going
        last = traceback.extract_tb(e.__traceback__)[-1]
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        status, detail = (
            FAIL,
            f"{type(e).__name__}: {msg} (at {os.path.basename(last.filename)}:{last.lineno})",
        )
    return Row(piece, status, detail, round(time.perf_counter() - t, 2))


def run(config_path: str, *, overrides: Sequence[str] = (), run_dir: str | None = None) -> dict:
    """Every row, in order; a row that raises fails with its one-line cause."""
    t0 = time.perf_counter()
    cfg = load_config(config_path, overrides)
    run_dir = run_dir or os.environ.get("TRN_ACCUM_RUN_DIR") or os.path.join("runs", "neuron-check")
    # before the backend starts: the runtime itself may bind the root port then
    on_neuron = platform.neuron_available()
    rows = [_row("root", lambda: node_rows.row_root(os.environ, on_neuron=on_neuron))]
    check = Check(cfg, run_dir)
    rows += [_row(piece, functools.partial(fn, check)) for piece, fn in ROWS]
    return {
        "config": config_path,
        "backend": jax.default_backend(),
        "devices": len(check.devices),
        "processes": jax.process_count(),
        "rows": [dataclasses.asdict(r) for r in rows],
        "passed": all(r.status != FAIL for r in rows),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def exit_code(report: dict) -> int:
    return EXIT_OK if report["passed"] else EXIT_FAILED


def format_report(report: dict, *, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(report, indent=2)
    width = max(len(r["piece"]) for r in report["rows"])
    lines = [
        f"neuron-check of {report['config']}: backend {report['backend']}, "
        f"{report['devices']} devices, {report['processes']} process(es)"
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['status']:<4}  {r['piece']:<{width}}  {r['detail']}  [{r['seconds']:.1f} s]"
        )
    failed = [r["piece"] for r in report["rows"] if r["status"] == FAIL]
    verdict = "all rows pass" if not failed else f"FAILED: {', '.join(failed)}"
    lines.append(f"{verdict} ({report['seconds']:.0f} s)")
    return "\n".join(lines)
