"""The NKI flash-attention adapter: kernel loading, layouts, LNC launch, custom VJP, per device.

`flash_attention(q, k, v)` is what `attention(..., impl="neuron_flash")` runs. The kernels are
the Neuron SDK's NKI Library training pair, written in the current `nki` namespace (`import
nki`, `nki.language`, `nki.jit`):

- forward: `nkilib.core.attention.attention_cte` with `cache_softmax=True` (its softmax
  statistics are what the backward needs);
- backward: `nkilib.core.attention.attention_bwd`.

Sources: the NKI Library kernel reference (awsdocs-neuron, nki/library/api/attention-cte) and
the kernels' source (github.com/aws-neuron/nki-library, src/nkilib_src/nkilib/core/attention/
attention_cte.py and attention_bwd.py). The legacy kernel namespace inside the neuronx-cc
package (the old `flash_fwd`/`flash_attn_bwd`) is a compile error inside a kernel from Neuron
2.28 and removed from neuronx-cc in 2.34 (the Neuron announcement "Announcing the removal of
the neuronxcc.nki namespace from neuronx-cc in Neuron 2.34",
about-neuron/announcements/neuron2.x/announce-removal-neuronxcc-nki-2-34); nothing here
imports it.

LNC. Both kernels take a 1-D SPMD grid of at most 2 programs and split their work over it
themselves, so they are launched as `kernel[lnc](...)`, `lnc` the job's logical-core size
(`platform.lnc_setting()`, the value `NEURON_LOGICAL_NC_CONFIG` gives the runtime): at LNC=2
both physical cores of a logical core work (nki.jit reference: the bracket LNC must match
`NEURON_LOGICAL_NC_CONFIG`). The old per-head grids (`[b, kv_heads]`) do not carry over.

Everything JAX-side (transposes, GQA folding, the log-sum-exp, the custom VJP, `shard_map`) is
unit-tested on CPU through `reference_kernels()` (`kernel_refs`: pure-JAX stand-ins with the
kernels' signatures, checks, layouts and rounding, NKI Library 2.30+). The dry-run and
`neuron-check` use them where the kernels are absent, and say so. Importing this module
imports no Neuron package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum.neuron import platform
from trn_accum.neuron.kernel_refs import (
    BWD_KEY_TILE,
    BWD_PARAMS,
    CTE_PARAMS,
    LSE_TILE,
    MAX_FWD_BATCH,
    MAX_HEAD_DIM,
    Launchable,
    bwd_key_tile,
    reference_kernels,
)

__all__ = [  # the kernels' contract lives in kernel_refs; callers reach it through here
    "BWD_KEY_TILE",
    "BWD_PARAMS",
    "CTE_PARAMS",
    "LSE_TILE",
    "MAX_FWD_BATCH",
    "MAX_HEAD_DIM",
    "Launchable",
    "active_kernels",
    "bwd_key_tile",
    "flash_attention",
    "load_nki_attention_kernels",
    "nki_flash_attention",
    "padded_seq_len",
    "reference_kernels",
    "shard_attention",
    "substitute",
    "substituted",
]

NEURON_EXTRA_HINT = (
    "run in the AWS Neuron JAX container (SDK 2.32+ ships nki and the NKI Library) or install "
    "the [neuron] extra from the Neuron pip repository, or use attention='blockwise'"
)
#: Where the kernels live, newest layout first (module, forward name, backward name).
KERNEL_MODULES = (
    ("nkilib.core.attention", "attention_cte", "attention_bwd"),
    ("nkilib.core", "attention_cte", "attention_bwd"),
)


def padded_seq_len(s: int) -> int:
    """S padded to what both kernels accept: a multiple of 128 up to 512, then of 512.

    The forward under cache_softmax needs S % 128 == 0; the backward tiles keys by
    min(512, S) and needs S % tile == 0, so 640 -> 1024 and 1152 -> 1536. Cost: attention
    FLOPs grow by about (Sp / S)^2 (causal), at most (1024 / 513)^2 = 3.98x at S=513 and
    under 1.2x from S = 5632 up; S = 8192 (Fuji 3B) pads nothing.
    """
    sp = -(-s // LSE_TILE) * LSE_TILE
    return sp if sp <= BWD_KEY_TILE else -(-s // BWD_KEY_TILE) * BWD_KEY_TILE


def _load_from(module: str, fwd: str, bwd: str) -> dict:
    """{"fwd", "bwd"} from `module`'s submodules or attributes; ImportError when absent."""
    found = {}
    for key, name in (("fwd", fwd), ("bwd", bwd)):
        try:
            found[key] = getattr(importlib.import_module(f"{module}.{name}"), name)
        except ModuleNotFoundError:
            found[key] = getattr(importlib.import_module(module), name)
    return found


def load_nki_attention_kernels() -> dict:
    """The NKI Library training pair as {"fwd": attention_cte, "bwd": attention_bwd} (`nki.jit`
    kernels), or a one-line ValueError naming what did not import and the fix."""
    errors = []
    try:
        importlib.import_module("nki")
    except Exception as err:  # ImportError, or the PyPI placeholder raising on import
        errors.append(f"nki: {type(err).__name__}")
    else:
        for module, fwd, bwd in KERNEL_MODULES:
            try:
                return _load_from(module, fwd, bwd)
            except Exception as err:
                errors.append(f"{module}: {type(err).__name__}")
    raise ValueError(
        "attention='neuron_flash' needs the NKI Library attention kernels "
        f"({'; '.join(errors)}): " + NEURON_EXTRA_HINT
    )


_SUBSTITUTE: list[dict] = []


@contextlib.contextmanager
def substitute(kernels: dict):
    """Within the block, `flash_attention` uses `kernels` (e.g. `reference_kernels()`) instead of
    loading the NKI Library: how the dry-run and `neuron-check` compile the adapter off-Neuron."""
    _SUBSTITUTE.append(kernels)
    try:
        yield kernels
    finally:
        _SUBSTITUTE.pop()


def substituted() -> bool:
    """Whether a `substitute(...)` block is active."""
    return bool(_SUBSTITUTE)


def active_kernels() -> dict:
    """The innermost `substitute(...)` kernels, else `load_nki_attention_kernels()`."""
    return _SUBSTITUTE[-1] if _SUBSTITUTE else load_nki_attention_kernels()


# ------------------------------------------------------------------------ the adapter


def nki_flash_attention(q, k, v, *, fwd, bwd, lnc: int | None = None, softmax_scale=None):
    """Causal GQA attention through the NKI training pair; all the layout adaptation is here.

    q [B, S, H, Dh], k/v [B, S, KV, Dh] (one device's shard) -> [B, S, H, Dh], q's dtype.

    - forward `fwd[lnc](q, k, v, scale=, causal_mask=True, tp_q=True, tp_k=True,
      cache_softmax=True)`: heads folded into the batch, q (B*H, Sp, Dh), k/v (B*KV, Sp, Dh)
      (query row b*H + h uses kv row b*KV + h // (H // KV): the kernel's native GQA);
      returns o (B*H, Sp, Dh), neg_max and recip (B*H, 128, Sp / 128) float32.
    - backward `bwd[lnc](q, k, v, o, dy, lse, use_causal_mask=True, mixed_precision=True,
      softmax_scale=, transpose_dv=True)` (NKI Library 2.30+; `cp_offset` stays 0: whole
      sequences per device): q/o/dy (B, H, Dh, Sp), k/v (B, KV, Dh, Sp) (native GQA), lse =
      -neg_max - log(recip) as (B, H, 128, Sp / 128); returns dq (B, H, Dh, Sp), dk
      (B, KV, Dh, Sp) and dv (B, Sp, KV, Dh), already our layout (the kernel transposes it on
      its way out, saving a transpose here).

    Sp = `padded_seq_len(S)` on the right (128s up to 512, then 512s; causal masking hides the
    padding from every real query). Kernel IO shares q's dtype (softmax statistics: float32).
    B*H above the forward's 512 (`MAX_FWD_BATCH`): the rows run in chunks of 512 // H, one
    kernel pair each.
    """
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    if dh > MAX_HEAD_DIM or h % kvh:
        raise ValueError(
            f"attention='neuron_flash': head_dim {dh} (at most {MAX_HEAD_DIM}) and heads {h} "
            f"(a multiple of kv heads {kvh}) do not fit the NKI kernels; use 'blockwise'"
        )
    lnc = platform.lnc_setting() if lnc is None else platform.check_lnc(lnc)
    rows = max(1, MAX_FWD_BATCH // h)  # the forward takes at most 512 (B*H) per launch
    if b > rows:  # a static loop over row chunks; each chunk is one kernel pair
        kw = dict(fwd=fwd, bwd=bwd, lnc=lnc, softmax_scale=softmax_scale)
        parts = [
            nki_flash_attention(q[i : i + rows], k[i : i + rows], v[i : i + rows], **kw)
            for i in range(0, b, rows)
        ]
        return jnp.concatenate(parts, axis=0)
    scale = dh**-0.5 if softmax_scale is None else float(softmax_scale)
    sp = padded_seq_len(s)
    dt = q.dtype

    def folded(x):  # [B, Sp, N, Dh] -> (B*N, Sp, Dh)
        return x.astype(dt).transpose(0, 2, 1, 3).reshape(-1, sp, dh)

    def heads_major(x):  # [B, Sp, N, Dh] -> (B, N, Dh, Sp)
        return x.astype(dt).transpose(0, 2, 3, 1)

    def forward(qp, kp, vp):
        o, neg_max, recip = fwd[lnc](
            folded(qp),
            folded(kp),
            folded(vp),
            scale=scale,
            causal_mask=True,
            tp_q=True,
            tp_k=True,
            tp_out=False,
            cache_softmax=True,
        )
        lse = (-neg_max - jnp.log(recip)).astype(jnp.float32).reshape(b, h, LSE_TILE, -1)
        return o.reshape(b, h, sp, dh), lse  # o (B, H, Sp, Dh)

    @jax.custom_vjp
    def run(qp, kp, vp):
        return forward(qp, kp, vp)[0].transpose(0, 2, 1, 3)

    def run_fwd(qp, kp, vp):
        o, lse = forward(qp, kp, vp)
        return o.transpose(0, 2, 1, 3), (qp, kp, vp, o, lse)

    def run_bwd(res, d_out):
        qp, kp, vp, o, lse = res
        dq, dk, dv = bwd[lnc](
            heads_major(qp),
            heads_major(kp),
            heads_major(vp),
            o.transpose(0, 1, 3, 2),
            heads_major(d_out),
            lse,
            use_causal_mask=True,
            mixed_precision=True,
            softmax_scale=scale,
            transpose_dv=True,
        )[:3]

        def back(x, like):  # (B, N, Dh, Sp) -> [B, Sp, N, Dh]
            return x.transpose(0, 3, 1, 2).astype(like.dtype)

        return back(dq, qp), back(dk, kp), dv.astype(vp.dtype)

    run.defvjp(run_fwd, run_bwd)
    pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    out = run(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad))
    return out[:, :s].astype(q.dtype)


def shard_attention(fn, q, k, v, mesh):
    """Run `fn(q, k, v)` per device under `jax.shard_map`: batch over the mesh's "data"/"fsdp"
    axes, heads over "model", sequence whole (a custom kernel cannot be partitioned by XLA).

    q [B, S, H, Dh], k/v [B, S, KV, Dh]; `mesh` a Mesh or AbstractMesh (axes already manual,
    e.g. inside an outer shard_map, are left alone).
    """
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if sizes.get("seq", 1) > 1 and "seq" not in manual:
        raise ValueError(
            f"attention='neuron_flash': the sequence is sharded over 'seq' ({sizes['seq']}); "
            "the kernel needs whole sequences: use attention='blockwise' or seq=1"
        )
    batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1 and a not in manual)
    head = "model" if sizes.get("model", 1) > 1 and "model" not in manual else None
    n_batch = math.prod(sizes[a] for a in batch)
    n_head = sizes[head] if head else 1
    if q.shape[0] % n_batch or k.shape[2] % n_head:
        raise ValueError(
            f"attention='neuron_flash': batch {q.shape[0]} must divide by {n_batch} "
            f"({'x'.join(batch)}) and KV heads {k.shape[2]} by {n_head} ('model')"
        )
    if not batch and head is None:
        return fn(q, k, v)
    spec = P(batch or None, None, head, None)
    if set(getattr(mesh, "explicit_axes", ())) & {*batch, head}:
        # Explicit-sharding axes: shard_map does not reshard its inputs itself.
        target = NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
        q, k, v = (jax.reshard(x, target) for x in (q, k, v))
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )
    return mapped(q, k, v)


def flash_attention(q, k, v, *, mesh=None, kernels=None, lnc: int | None = None):
    """Causal GQA attention through the NKI kernels, per device over `mesh` (default: the
    ambient mesh of `jax.set_mesh`, if any). `kernels`: {"fwd", "bwd"} (default
    `active_kernels()`: a one-line ValueError where they are missing); `lnc` default
    `platform.lnc_setting()`."""
    kernels = active_kernels() if kernels is None else kernels
    fn = functools.partial(nki_flash_attention, fwd=kernels["fwd"], bwd=kernels["bwd"], lnc=lnc)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return fn(q, k, v)
    return shard_attention(fn, q, k, v, mesh)
