"""The NKI Library training pair's contract, and pure-JAX stand-ins that keep it on CPU.

The pair: `nkilib.core.attention.attention_cte` (forward, with `cache_softmax=True`) and
`nkilib.core.attention.attention_bwd` (backward). The stand-ins take the kernels' parameters in
the kernels' positional order, make the kernels' own input checks, return the kernels' layouts
and round where the kernels round, so the adapter (`kernels.nki_flash_attention`) is tested on
CPU against what it will meet on Neuron. Importing this module imports no Neuron package.

Sources (src/nkilib_src/nkilib/core/attention/ in each):
- 2.29: github.com/aws-neuron/nki-library at tag 2.29 (ddbca35, unchanged at d2ad3a5,
  2026-04-13), the newest tag of the official repository reachable here. "CTE:n" and "BWD:n"
  below are lines of attention_cte.py and attention_bwd.py at that tag.
- 2.30+: the NKI Library release that gives attention_bwd `transpose_dv` and `cp_offset`
  (Neuron 2.30, per the issue this was written for). No official tag after 2.29 was reachable,
  so the new code was read from github.com/RuifengHua/nki-library, a fork that carries it:
  attention_bwd.py at c38d790 ("BWD+:n": the signature, lines 44-59, equal to 2.29's up to
  line 57) and attention_cte.py at 26628c5 (two trailing parameters after `bound_max`).
  Where its lines shift, the rule is named by function and message.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

LSE_TILE = 128  # the kernels' softmax-statistics tile (nl.tile_size.pmax): queries per row
MAX_HEAD_DIM = 128
MAX_FWD_BATCH = 512  # bs (B*H per device) at most 512: CTE:140 `_MAX_BS`, asserted CTE:379
# attention_bwd tiles keys by min(nl.tile_size.psum_fmax = 512, seqlen_k) (BWD:364 default,
# BWD:405 `k_seq_tile_size = min(k_seq_tile_size, seqlen_k)` in `setup_config`, BWD:357) and
# asserts seqlen_k % tile == 0 (BWD:414, "Key sequence length should be multiple of ...");
# unchanged in 2.30+ `setup_config`.
BWD_KEY_TILE = 512
#: The kernels' parameters in their positional order (CTE:169 `attention_cte` plus the 2.30+
#: `cp_striped_input`, `skip_output_normalization` after `bound_max`; BWD:44 `attention_bwd`
#: plus BWD+:58 `transpose_dv`, BWD+:59 `cp_offset`): the stand-ins take the same, so a
#: positional call means the same thing.
CTE_PARAMS = (
    "q",
    "k",
    "v",
    "scale",
    "causal_mask",
    "k_prior",
    "v_prior",
    "prior_used_len",
    "sink",
    "sliding_window",
    "tp_q",
    "tp_k",
    "tp_out",
    "cache_softmax",
    "softmax_dtype",
    "mm_out_dtype",
    "cp_offset",
    "global_cp_deg",
    "cp_strided_q_slicing",
    "bound_min",
    "bound_max",
    "cp_striped_input",
    "skip_output_normalization",
)
BWD_PARAMS = (
    "q_ref",
    "k_ref",
    "v_ref",
    "o_ref",
    "dy_ref",
    "lse_ref",
    "sinks_ref",
    "bound_min",
    "bound_max",
    "use_causal_mask",
    "mixed_precision",
    "softmax_scale",
    "sliding_window",
    "transpose_dv",
    "cp_offset",
)


def bwd_key_tile(seqlen_k: int) -> int:
    """The backward's key tile: min(512, seqlen_k); seqlen_k must be a multiple of it."""
    return min(BWD_KEY_TILE, seqlen_k)


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


def causal_visible(sq: int, sk: int, cp_offset: int = 0):
    """[Sq, Sk] bool: query i sees key j when i + cp_offset >= j (BWD+ `recompute_qk_softmax`:
    the affine_select offset `grp_idx * q_seq_tile_size + cp_offset - k_tile_start_pos`)."""
    return jnp.arange(sq)[:, None] + cp_offset >= jnp.arange(sk)[None, :]


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
    cp_striped_input=False,
    skip_output_normalization=False,
):
    """Stand-in for nkilib attention_cte (documented IO, the kernel's positional order,
    CTE_PARAMS): q (Bq, S, d) if tp_q else (Bq, d, S); k (Bkv, S, d) if tp_k else (Bkv, d, S);
    v (Bkv, S, d); GQA when Bkv < Bq (query row i uses kv row i // (Bq // Bkv)). Returns out
    (Bq, S, d) (tp_out: (Bq, d, S)) and, with cache_softmax, neg_max and recip
    (Bq, 128, ceil(S / 128)) float32, query g*128 + p at [.., p, g]. The scale multiplies the
    float32 scores (CTE:2718 `operand0=ac.scale`). Causal, without prefix caching, sinks,
    sliding window, context parallelism, sequence packing or unnormalized output (the adapter
    uses none of them)."""
    unsupported = (k_prior, v_prior, prior_used_len, sink, cp_offset, global_cp_deg, bound_min)
    assert causal_mask and not sliding_window, "stand-in: causal only"
    assert all(x is None for x in (*unsupported, bound_max)), "stand-in: no optional inputs"
    # 2.30+: skip_output_normalization "Must be used together with cache_softmax=True"
    unnormalized = skip_output_normalization
    assert cache_softmax or not unnormalized, "skip_output_normalization needs cache_softmax"
    assert not (cp_striped_input or unnormalized), "stand-in: no CP, normalized output"
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
    s = jnp.einsum("nqd,nkd->nqk", qf, kf) * scale
    s = jnp.where(causal_visible(sq, kf.shape[1]), s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - m[..., None])
    total = p.sum(axis=-1)
    out = (jnp.einsum("nqk,nkd->nqd", p, vf) / total[..., None]).astype(q.dtype)
    if tp_out:
        out = out.transpose(0, 2, 1)
    if not cache_softmax:
        return out
    n = m.shape[0]
    grps = -(-sq // LSE_TILE)
    pad = ((0, 0), (0, grps * LSE_TILE - sq))

    def tiles(x):  # [N, Sq] -> [N, 128, grps], query g*128 + p at [:, p, g]
        return jnp.pad(x, pad, constant_values=1.0).reshape(n, grps, LSE_TILE).transpose(0, 2, 1)

    return out, tiles(-m), tiles(1.0 / total)


def _check_bwd_inputs(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, use_causal_mask, cp_offset):
    """The kernel's `validate_inputs` and `setup_config` checks that apply to the stand-in."""
    b, h, d, sq = q_ref.shape
    kvh, sk = k_ref.shape[1], k_ref.shape[-1]
    # `validate_inputs` (BWD:188; 2.30+ adds cp_offset): heads a multiple of KV heads (BWD:226);
    # k/v/o/dy shapes (BWD:230-233); lse shape (BWD:234)
    assert h % kvh == 0, f"query heads {h} not a multiple of KV heads {kvh}"
    assert k_ref.shape == v_ref.shape == (b, kvh, d, sk), "k/v shape"
    assert o_ref.shape == dy_ref.shape == q_ref.shape, "o and dy must have q's shape"
    assert lse_ref.shape == (b, h, LSE_TILE, sq // LSE_TILE), f"lse shape {lse_ref.shape}"
    # causal => seqlen_q == seqlen_k (BWD:244), "or cp_offset > 0" from 2.30 (BWD+
    # `validate_inputs`): a context-parallel query chunk sits cp_offset past key 0
    assert not use_causal_mask or sq == sk or cp_offset > 0, (
        f"causal: seqlen_q {sq} != seqlen_k {sk} needs cp_offset > 0 (got {cp_offset})"
    )
    dtypes = {x.dtype for x in (q_ref, k_ref, v_ref, o_ref, dy_ref)}  # one dtype (BWD:248)
    assert len(dtypes) == 1, f"q/k/v/o/dy must share a dtype, got {sorted(map(str, dtypes))}"
    # `setup_config` (BWD:357): key tile min(512, seqlen_k) (BWD:405), seqlen_k % tile
    # (BWD:414), seqlen_q % 128 (the query tile, BWD:425)
    tile = bwd_key_tile(sk)
    assert sk % tile == 0, f"seqlen_k {sk} % key tile {tile} != 0"
    assert sq % LSE_TILE == 0, f"seqlen_q {sq} % query tile {LSE_TILE} != 0"


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
    transpose_dv=False,
    cp_offset=0,
):
    """Stand-in for nkilib attention_bwd 2.30+ (documented IO, the kernel's positional order,
    BWD_PARAMS): q, o, dy (B, H, d, Sq); k, v (B, KV, d, Sk); lse (B, H, 128, Sq // 128);
    returns dq (B, H, d, Sq), dk (B, KV, d, Sk), dv (B, KV, d, Sk), or dv (B, Sk, KV, d) with
    `transpose_dv`. Query i sees key j when i + cp_offset >= j. Causal, without sinks, sliding
    window or sequence packing (bound_min/bound_max).

    Numerics as the 2.30+ kernel computes them: Q stays unscaled; the scale multiplies the
    float32 scores inside the exponential (`recompute_qk_softmax`: `nisa.activation(op=exp,
    bias=-lse, scale=softmax_scale)`; 2.29 multiplied Q by it in the input dtype at load,
    BWD:790 `scale_first=softmax_scale`, and used scale=1.0); dK gets the scale after its
    matmul (`_flash_attn_bwd_core`, "Post-multiply by softmax_scale since Q is loaded
    unscaled"); D = rowsum(dy * o) is float32 whatever the dtype (`dy_o_sum` float32; 2.29:
    the accumulation dtype, BWD:1147). The softmax and its gradient are rounded to the input
    dtype (`softmax_y`, `softmax_dx_local`); matmuls accumulate in float32, and so do dq/dk/dv
    with `mixed_precision` (else in the input dtype). It uses o and lse as the kernel does, so
    a layout error in either changes the gradients."""
    # BWD:259: bound_min and bound_max both given or both None (this stand-in: None)
    assert (bound_min is None) == (bound_max is None), "bound_min/bound_max: both or neither"
    assert bound_min is None and not sliding_window, "stand-in: no packing, no sliding window"
    assert use_causal_mask and sinks_ref is None, "stand-in: causal, no sinks"
    _check_bwd_inputs(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, use_causal_mask, cp_offset)
    b, h, d, sq = q_ref.shape
    kvh, sk = k_ref.shape[1], k_ref.shape[-1]
    g = h // kvh
    io = q_ref.dtype
    acc = jnp.float32 if mixed_precision else io
    scale = softmax_scale or d**-0.5
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    q, o, dy = (f32(x).transpose(0, 1, 3, 2) for x in (q_ref, o_ref, dy_ref))  # (B, H, Sq, d)
    k, v = (jnp.repeat(f32(x).transpose(0, 1, 3, 2), g, axis=1) for x in (k_ref, v_ref))
    neg_lse = (-f32(lse_ref)).astype(acc).astype(jnp.float32)  # `softmax_exp_bias`, acc dtype
    neg_lse = neg_lse.transpose(0, 1, 3, 2).reshape(b, h, sq)  # query g*128 + p
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)  # float32 PSUM, unscaled
    visible = causal_visible(sq, sk, cp_offset)
    prob = jnp.where(visible, jnp.exp(scores * scale + neg_lse[..., None]), 0.0)
    prob = prob.astype(io).astype(jnp.float32)  # `softmax_y`: the input dtype
    big_d = (dy * o).sum(-1, keepdims=True)  # `dy_o_sum`: float32
    dp = jnp.einsum("bhqd,bhkd->bhqk", dy, v)
    ds = (prob * (dp - big_d)).astype(io).astype(jnp.float32)  # `softmax_dx_local`
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q) * scale  # the 2.30+ post-scale
    dv = jnp.einsum("bhqk,bhqd->bhkd", prob, dy)

    def kv(x):  # (B, H, Sk, d) -> sum over each group -> (B, KV, Sk, d)
        return x.astype(acc).reshape(b, kvh, g, sk, d).sum(axis=2, dtype=acc)

    dv = kv(dv).astype(v_ref.dtype)  # (B, KV, Sk, d)
    return (
        dq.astype(acc).transpose(0, 1, 3, 2).astype(io),
        kv(dk).transpose(0, 1, 3, 2).astype(k_ref.dtype),
        dv.transpose(0, 2, 1, 3) if transpose_dv else dv.transpose(0, 1, 3, 2),
    )


def reference_kernels() -> dict:
    """Pure-JAX stand-ins for {"fwd", "bwd"} (exact attention, the kernels' documented IO)."""
    return {
        "fwd": Launchable(_ref_attention_cte, "attention_cte (reference)"),
        "bwd": Launchable(_ref_attention_bwd, "attention_bwd (reference)"),
    }
