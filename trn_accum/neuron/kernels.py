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
unit-tested on CPU through `reference_kernels()`: pure-JAX stand-ins with the kernels'
documented signatures and layouts. The dry-run and `neuron-check` use them where the kernels
are absent, and say so. Importing this module imports no Neuron package.
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

NEURON_EXTRA_HINT = (
    "run in the AWS Neuron JAX container (SDK 2.32+ ships nki and the NKI Library) or install "
    "the [neuron] extra from the Neuron pip repository, or use attention='blockwise'"
)
#: Where the kernels live, newest layout first (module, forward name, backward name).
KERNEL_MODULES = (
    ("nkilib.core.attention", "attention_cte", "attention_bwd"),
    ("nkilib.core", "attention_cte", "attention_bwd"),
)
LSE_TILE = 128  # the kernels' softmax-statistics tile (nl.tile_size.pmax): queries per row
MAX_HEAD_DIM = 128
# Line numbers below: aws-neuron/nki-library at tag 2.29 (unchanged at d2ad3a5, 2026-04-13),
# src/nkilib_src/nkilib/core/attention/ (CTE = attention_cte.py, BWD = attention_bwd.py).
MAX_FWD_BATCH = 512  # bs (B*H per device) at most 512: CTE:140 `_MAX_BS`, asserted CTE:379
# attention_bwd tiles keys by min(nl.tile_size.psum_fmax = 512, seqlen_k) (BWD:364 default,
# BWD:405 `k_seq_tile_size = min(k_seq_tile_size, seqlen_k)` in `setup_config`, BWD:357) and
# asserts seqlen_k % tile == 0 (BWD:414, "Key sequence length should be multiple of ...")
BWD_KEY_TILE = 512
#: The kernels' parameters in their positional order (CTE:169 `attention_cte`, BWD:44
#: `attention_bwd`): the stand-ins take the same, so a positional call means the same thing.
CTE_PARAMS = (
    "q", "k", "v", "scale", "causal_mask", "k_prior", "v_prior", "prior_used_len", "sink",
    "sliding_window", "tp_q", "tp_k", "tp_out", "cache_softmax", "softmax_dtype",
    "mm_out_dtype", "cp_offset", "global_cp_deg", "cp_strided_q_slicing", "bound_min",
    "bound_max",
)  # fmt: skip
BWD_PARAMS = (
    "q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref", "sinks_ref", "bound_min",
    "bound_max", "use_causal_mask", "mixed_precision", "softmax_scale", "sliding_window",
)  # fmt: skip


def bwd_key_tile(seqlen_k: int) -> int:
    """The backward's key tile: min(512, seqlen_k); seqlen_k must be a multiple of it."""
    return min(BWD_KEY_TILE, seqlen_k)


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


# ------------------------------------------------------------------- the CPU stand-ins


class Launchable:
    """A function launched like an `nki.jit` kernel: `kernel[grid](*args)` or `kernel(*args)`.
    The stand-ins record the grids they were launched with (`grids`), so tests can check the
    LNC launch."""

    def __init__(self, fn, name: str):
        self.fn, self.name, self.grids = fn, name, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.fn

    def __call__(self, *args, **kwargs):
        self.grids.append(None)
        return self.fn(*args, **kwargs)


def _causal_scores(q, k, scale):
    """q [N, Sq, d], k [N, Sk, d] (float32) -> scaled causal scores [N, Sq, Sk], -inf above."""
    s = jnp.einsum("nqd,nkd->nqk", q, k) * scale
    sq, sk = s.shape[1:]
    mask = jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]
    return jnp.where(mask, s, -jnp.inf)


def _ref_attention_cte(
    q,
    k,
    v,
    scale=1.0,
    causal_mask=True,
    k_prior=None,
    v_prior=None,
    prior_used_len=None,
    sink=None,
    sliding_window=None,
    tp_q=True,
    tp_k=False,
    tp_out=False,
    cache_softmax=False,
    softmax_dtype=None,
    mm_out_dtype=None,
    cp_offset=None,
    global_cp_deg=None,
    cp_strided_q_slicing=False,
    bound_min=None,
    bound_max=None,
):
    """Stand-in for nkilib attention_cte (documented IO, the kernel's positional order,
    CTE_PARAMS): q (Bq, S, d) if tp_q else (Bq, d, S); k (Bkv, S, d) if tp_k else (Bkv, d, S);
    v (Bkv, S, d); GQA when Bkv < Bq (query row i uses kv row i // (Bq // Bkv)). Returns out
    (Bq, S, d) (tp_out: (Bq, d, S)) and, with cache_softmax, neg_max and recip
    (Bq, 128, ceil(S / 128)) float32, query g*128 + p at [.., p, g]. Causal, without prefix
    caching, sinks, sliding window, context parallelism or sequence packing (the adapter
    uses none of them)."""
    unsupported = (k_prior, v_prior, prior_used_len, sink, cp_offset, global_cp_deg, bound_min)
    assert causal_mask and not sliding_window, "stand-in: causal only"
    assert all(x is None for x in (*unsupported, bound_max)), "stand-in: no optional inputs"
    # The kernel's own checks (CTE = attention_cte.py at nki-library 2.29, see above):
    sq = q.shape[1] if tp_q else q.shape[2]
    # CTE:379 bs <= _MAX_BS (512)
    assert q.shape[0] <= MAX_FWD_BATCH, f"bs {q.shape[0]} > {MAX_FWD_BATCH} (B*H per device)"
    # CTE:1625 (in `_check_input_and_return_shape`): seqlen_q % 128 under cache_softmax
    assert not cache_softmax or sq % LSE_TILE == 0, f"cache_softmax: S {sq} % {LSE_TILE} != 0"
    # CTE:384 bs % bs_kv == 0; CTE:412 d <= _MAX_HEAD_DIM (128)
    assert q.shape[0] % k.shape[0] == 0, f"q batch {q.shape[0]} % kv batch {k.shape[0]} != 0"
    assert q.shape[-1 if tp_q else 1] <= MAX_HEAD_DIM, f"head dim > {MAX_HEAD_DIM}"
    qf = (q if tp_q else q.transpose(0, 2, 1)).astype(jnp.float32)
    kf = (k if tp_k else k.transpose(0, 2, 1)).astype(jnp.float32)
    g = qf.shape[0] // kf.shape[0]
    kf = jnp.repeat(kf, g, axis=0)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=0)
    s = _causal_scores(qf, kf, scale)
    m = s.max(axis=-1)
    p = jnp.exp(s - m[..., None])
    total = p.sum(axis=-1)
    out = (jnp.einsum("nqk,nkd->nqd", p, vf) / total[..., None]).astype(q.dtype)
    if tp_out:
        out = out.transpose(0, 2, 1)
    if not cache_softmax:
        return out
    n, sq = m.shape
    grps = -(-sq // LSE_TILE)
    pad = ((0, 0), (0, grps * LSE_TILE - sq))

    def tiles(x):  # [N, Sq] -> [N, 128, grps], query g*128 + p at [:, p, g]
        return jnp.pad(x, pad, constant_values=1.0).reshape(n, grps, LSE_TILE).transpose(0, 2, 1)

    return out, tiles(-m), tiles(1.0 / total)


def _ref_attention_bwd(
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    dy_ref,
    lse_ref,
    sinks_ref=None,
    bound_min=None,
    bound_max=None,
    use_causal_mask=False,
    mixed_precision=False,
    softmax_scale=None,
    sliding_window=None,
):
    """Stand-in for nkilib attention_bwd (documented IO, the kernel's positional order,
    BWD_PARAMS): q, o, dy (B, H, d, S); k, v (B, KV, d, S); lse (B, H, 128, S // 128); returns
    dq (B, H, d, S), dk, dv (B, KV, d, S). It uses o and lse as the kernel does (softmax
    rebuilt from lse, D = rowsum(dy * o)), so a layout error in either changes the gradients.
    Causal, without sinks, sliding window or sequence packing (bound_min/bound_max)."""
    # BWD:259: bound_min and bound_max both given or both None (this stand-in: None)
    assert (bound_min is None) == (bound_max is None), "bound_min/bound_max: both or neither"
    assert bound_min is None and not sliding_window, "stand-in: no packing, no sliding window"
    assert use_causal_mask and sinks_ref is None, "stand-in: causal, no sinks"
    b, h, d, s = q_ref.shape
    # The kernel's `validate_inputs` (BWD:188, attention_bwd.py at nki-library 2.29):
    # BWD:226 heads a multiple of KV heads; BWD:230-233 k/v/o/dy shapes; BWD:234 lse shape;
    # BWD:244 causal => seqlen_q == seqlen_k; BWD:248 one dtype for q/k/v/o/dy
    assert h % k_ref.shape[1] == 0, f"query heads {h} not a multiple of KV heads {k_ref.shape[1]}"
    assert k_ref.shape == v_ref.shape == (b, k_ref.shape[1], d, k_ref.shape[-1]), "k/v shape"
    assert not use_causal_mask or k_ref.shape[-1] == s, f"causal: seqlen_q {s} != seqlen_k"
    dtypes = {x.dtype for x in (q_ref, k_ref, v_ref, o_ref, dy_ref)}
    assert len(dtypes) == 1, f"q/k/v/o/dy must share a dtype, got {sorted(map(str, dtypes))}"
    assert o_ref.shape == dy_ref.shape == q_ref.shape, "o and dy must have q's shape"
    assert lse_ref.shape == (b, h, LSE_TILE, s // LSE_TILE), f"lse shape {lse_ref.shape}"
    # `setup_config` (BWD:357): BWD:405 key tile min(512, seqlen_k), BWD:414 seqlen_k % tile,
    # BWD:425 seqlen_q % 128 (the query tile)
    tile = bwd_key_tile(k_ref.shape[-1])
    assert k_ref.shape[-1] % tile == 0, f"seqlen_k {k_ref.shape[-1]} % key tile {tile} != 0"
    assert s % LSE_TILE == 0, f"seqlen_q {s} % query tile {LSE_TILE} != 0"
    kvh = k_ref.shape[1]
    g = h // kvh
    scale = softmax_scale or d**-0.5
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    q, o, dy = (f32(x).transpose(0, 1, 3, 2) for x in (q_ref, o_ref, dy_ref))  # (B, H, S, d)
    k, v = (jnp.repeat(f32(x).transpose(0, 1, 3, 2), g, axis=1) for x in (k_ref, v_ref))
    lse = f32(lse_ref).transpose(0, 1, 3, 2).reshape(b, h, s)  # query g*128 + p
    sc = _causal_scores(q.reshape(b * h, s, d), k.reshape(b * h, s, d), scale).reshape(b, h, s, s)
    prob = jnp.exp(sc - lse[..., None])
    dv = jnp.einsum("bhqk,bhqd->bhkd", prob, dy)
    dp = jnp.einsum("bhqd,bhkd->bhqk", dy, v)
    ds = prob * (dp - (dy * o).sum(-1, keepdims=True))
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q) * scale

    def kv(x):  # (B, H, S, d) -> sum over each group -> (B, KV, d, S)
        return x.reshape(b, kvh, g, s, d).sum(axis=2).transpose(0, 1, 3, 2)

    return (
        dq.transpose(0, 1, 3, 2).astype(q_ref.dtype),
        kv(dk).astype(k_ref.dtype),
        kv(dv).astype(v_ref.dtype),
    )


def reference_kernels() -> dict:
    """Pure-JAX stand-ins for {"fwd", "bwd"} (exact attention, the kernels' documented IO)."""
    return {
        "fwd": Launchable(_ref_attention_cte, "attention_cte (reference)"),
        "bwd": Launchable(_ref_attention_bwd, "attention_bwd (reference)"),
    }


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
      softmax_scale=)`: q/o/dy (B, H, Dh, Sp), k/v (B, KV, Dh, Sp) (native GQA), lse =
      -neg_max - log(recip) as (B, H, 128, Sp / 128); returns dq (B, H, Dh, Sp), dk/dv
      (B, KV, Dh, Sp).

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
        parts = [nki_flash_attention(q[i : i + rows], k[i : i + rows], v[i : i + rows], **kw)
                 for i in range(0, b, rows)]  # fmt: skip
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
        )[:3]

        def back(x, like):  # (B, N, Dh, Sp) -> [B, Sp, N, Dh]
            return x.transpose(0, 3, 1, 2).astype(like.dtype)

        return back(dq, qp), back(dk, kp), back(dv, vp)

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
