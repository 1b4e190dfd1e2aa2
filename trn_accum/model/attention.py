"""Causal grouped-query attention kernels.

Shapes: q [B, S, H, Dh]; k, v [B, S, KV, Dh] with H % KV == 0 (query heads h*G ... h*G+G-1
share KV head h, G = H // KV). Output [B, S, H, Dh] in q's dtype. Softmax in float32, scale
Dh**-0.5. `kv_mask` (optional, bool [B, S]): False marks a padded key position that no query may
attend to.

Implementations (`attention(..., impl=...)`):

- "plain": materialises the [B, KV, G, S, S] float32 scores. The reference.
- "blockwise": pure JAX flash attention. Queries and keys in blocks of `block_size`, an online
  softmax in float32, one `lax.scan` over the n(n+1)/2 causal (query block, key block) pairs
  (static trip count; blocks above the diagonal are never computed). Its custom VJP saves only
  q, k, v, the output and the float32 log-sum-exp (the last two named `RESIDUAL_NAMES`, which
  a remat policy can keep) and recomputes each block's scores in the
  backward pass, so neither direction holds an [S, S] buffer: memory grows with S * block.
  GQA without repeating K/V heads. Any S (padded internally to a multiple of the block, masked).
- "flash": pure JAX flash attention with no loops (`trn_accum.model.flash`): per query block its
  output and log-sum-exp, then one backward pass over the same rows (dq per row, dk/dv summed
  per key block), each result block written once, five large batched dots per piece of a row;
  static slices only. Any S, `kv_mask`.
- "neuron_flash": the Neuron SDK's NKI Library training kernels (`attention_cte` forward with
  cached softmax statistics, `attention_bwd`; `nki` namespace) in a custom VJP, launched on the
  job's logical-core grid; the adapter is `trn_accum.neuron.kernels` (unit-tested on CPU with
  pure-JAX stand-ins of the kernels' documented IO). No `kv_mask` (the kernels take none);
  causal masking alone already hides right-padding from every real token.

A query that sees no key at all (every causally visible key masked by `kv_mask`) has no defined
output: "plain" returns the mean of all values, "blockwise" and "flash" return zeros (and zero
gradients). Mask the loss of such positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from trn_accum.core.constraints import varying_like
from trn_accum.model.flash import MASK_VALUE as _MASK_VALUE
from trn_accum.model.flash import RESIDUAL_NAMES, flash_attention, name_residuals
from trn_accum.neuron import kernels as nki_kernels  # the NKI adapter; no Neuron import

IMPLS = ("plain", "blockwise", "flash", "neuron_flash")
# The impls whose output and log-sum-exp are named `RESIDUAL_NAMES` (remat save_attention)
NAMES_RESIDUALS = ("blockwise", "flash")
# The impls that take `block_size` (model.attention_block)
BLOCKED = ("blockwise", "flash")
__all__ = [
    "BLOCKED",
    "IMPLS",
    "NAMES_RESIDUALS",
    "RESIDUAL_NAMES",
    "attention",
    "blockwise_attention",
    "plain_attention",
]


def plain_attention(q, k, v, kv_mask=None):
    """Reference attention: materialises the [B, KV, G, S, S] float32 scores."""
    b, s, h, dh = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, s, kv, g, dh)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    visible = jnp.tril(jnp.ones((s, s), dtype=bool))[None, None, None]
    if kv_mask is not None:
        visible = visible & kv_mask[:, None, None, None, :]
    scores = jnp.where(visible, scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, dh).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# blockwise (pure JAX flash attention)
# ----------------------------------------------------------------------------------------------


def _causal_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(query block, key block) pairs with key <= query, row-major: (0,0), (1,0), (1,1), ..."""
    rows, cols = np.tril_indices(n)
    return rows.astype(np.int32), cols.astype(np.int32)


def _block_visible(i, j, valid, block):
    """bool [B, 1, 1, bq, bk]: key j*block+t visible to query i*block+r (causal and valid)."""
    r = lax.broadcasted_iota(jnp.int32, (block, block), 0) + i * block
    t = lax.broadcasted_iota(jnp.int32, (block, block), 1) + j * block
    return (t <= r)[None, None, None] & valid[:, None, None, None, :]


def _block_scores(qb, kb, scale):
    """qb [B, bq, KV, G, Dh], kb [B, bk, KV, Dh] -> float32 scores [B, KV, G, bq, bk]."""
    return jnp.einsum("bqkgd,btkd->bkgqt", qb, kb, preferred_element_type=jnp.float32) * scale


def _flash_forward(q, k, v, key_valid, block):
    """Forward pass on padded inputs; returns o [B, KV, G, Sp, Dh] (q.dtype), lse [B, KV, G, Sp]."""
    b, sp, kvh, g, dh = q.shape
    scale = dh**-0.5
    rows, cols = _causal_pairs(sp // block)
    f32 = jnp.float32

    def step(carry, ij):
        m, l, acc, o_buf, lse_buf = carry
        i, j = ij
        fresh = j == 0  # first key block of a new query row: reset the running statistics
        m = jnp.where(fresh, _MASK_VALUE, m)
        l = jnp.where(fresh, 0.0, l)
        acc = jnp.where(fresh, 0.0, acc)
        qb = lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
        kb = lax.dynamic_slice_in_dim(k, j * block, block, axis=1)
        vb = lax.dynamic_slice_in_dim(v, j * block, block, axis=1)
        valid = lax.dynamic_slice_in_dim(key_valid, j * block, block, axis=1)
        vis = _block_visible(i, j, valid, block)
        s = jnp.where(vis, _block_scores(qb, kb, scale), _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum("bkgqt,btkd->bkgqd", p.astype(v.dtype), vb, preferred_element_type=f32)
        acc = alpha[..., None] * acc + pv
        # Write this row's current result; the row's last pair (j == i) writes the final one.
        l_safe = jnp.where(l > 0.0, l, 1.0)
        o_blk = (acc / l_safe[..., None]).astype(o_buf.dtype)
        o_buf = lax.dynamic_update_slice_in_dim(o_buf, o_blk, i * block, axis=3)
        lse_buf = lax.dynamic_update_slice_in_dim(lse_buf, m_new + jnp.log(l_safe), i * block, 3)
        return (m_new, l, acc, o_buf, lse_buf), None

    init = (
        jnp.full((b, kvh, g, block), _MASK_VALUE, f32),
        jnp.zeros((b, kvh, g, block), f32),
        jnp.zeros((b, kvh, g, block, dh), f32),
        jnp.zeros((b, kvh, g, sp, dh), q.dtype),
        jnp.zeros((b, kvh, g, sp), f32),
    )
    init = varying_like(init, q, k, v, key_valid)  # inside shard_map (reduce="once")
    (_, _, _, o, lse), _ = lax.scan(step, init, (jnp.asarray(rows), jnp.asarray(cols)))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, key_valid, block):
    """q [B, Sp, KV, G, Dh], k/v [B, Sp, KV, Dh], key_valid bool [B, Sp]; Sp % block == 0."""
    o, _ = _flash_forward(q, k, v, key_valid, block)
    return o.transpose(0, 3, 1, 2, 4)


def _flash_fwd_rule(q, k, v, key_valid, block):
    o, lse = name_residuals(*_flash_forward(q, k, v, key_valid, block))
    return o.transpose(0, 3, 1, 2, 4), (q, k, v, key_valid, o, lse)


def _flash_bwd_rule(block, res, d_out):
    """Recompute each block's probabilities from lse; accumulate dq, dk, dv in float32."""
    q, k, v, key_valid, o, lse = res
    b, sp, kvh, g, dh = q.shape
    scale = dh**-0.5
    f32 = jnp.float32
    do = d_out.astype(o.dtype).transpose(0, 2, 3, 1, 4)  # [B, KV, G, Sp, Dh]
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1)  # [B, KV, G, Sp]
    rows, cols = _causal_pairs(sp // block)

    def step(carry, ij):
        dq, dk, dv = carry
        i, j = ij
        qb = lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
        kb = lax.dynamic_slice_in_dim(k, j * block, block, axis=1)
        vb = lax.dynamic_slice_in_dim(v, j * block, block, axis=1)
        valid = lax.dynamic_slice_in_dim(key_valid, j * block, block, axis=1)
        dob = lax.dynamic_slice_in_dim(do, i * block, block, axis=3)
        lse_b = lax.dynamic_slice_in_dim(lse, i * block, block, axis=3)
        delta_b = lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
        vis = _block_visible(i, j, valid, block)
        s = jnp.where(vis, _block_scores(qb, kb, scale), _MASK_VALUE)
        p = jnp.where(vis, jnp.exp(s - lse_b[..., None]), 0.0)  # [B, KV, G, bq, bk]
        dv_j = jnp.einsum("bkgqt,bkgqd->btkd", p.astype(do.dtype), dob, preferred_element_type=f32)
        dp = jnp.einsum("bkgqd,btkd->bkgqt", dob, vb, preferred_element_type=f32)
        ds = p * (dp - delta_b[..., None])
        dq_i = jnp.einsum("bkgqt,btkd->bqkgd", ds.astype(k.dtype), kb, preferred_element_type=f32)
        dk_j = jnp.einsum("bkgqt,bqkgd->btkd", ds.astype(q.dtype), qb, preferred_element_type=f32)

        def add(buf, upd, start):
            cur = lax.dynamic_slice_in_dim(buf, start, block, axis=1)
            return lax.dynamic_update_slice_in_dim(buf, cur + upd, start, axis=1)

        dq = add(dq, dq_i * scale, i * block)
        dk = add(dk, dk_j * scale, j * block)
        dv = add(dv, dv_j, j * block)
        return (dq, dk, dv), None

    init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    init = varying_like(init, q, k, v, key_valid, d_out)
    (dq, dk, dv), _ = lax.scan(step, init, (jnp.asarray(rows), jnp.asarray(cols)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def blockwise_attention(q, k, v, kv_mask=None, *, block_size: int = 512):
    """Flash attention in pure JAX (see module docstring). Same contract as `plain_attention`.

    `block_size` (query and key block, tokens) is clamped to S; S need not be a multiple of it.
    Temporary memory per step: float32 [B, H, block, block] scores (plus their gradient terms).
    """
    if block_size < 1:
        raise ValueError(f"attention: block_size={block_size} must be >= 1 (e.g. 512)")
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    block = min(block_size, s)
    sp = -(-s // block) * block
    key_valid = jnp.broadcast_to(jnp.arange(sp) < s, (b, sp))
    if kv_mask is not None:
        key_valid = key_valid & jnp.pad(kv_mask.astype(bool), ((0, 0), (0, sp - s)))
    pad = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    qp, kp, vp = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    out = _flash(qp.reshape(b, sp, kvh, h // kvh, dh), kp, vp, key_valid, block)
    return out.reshape(b, sp, h, dh)[:, :s]


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------


def attention(q, k, v, *, impl: str = "plain", block_size: int = 512, kv_mask=None, mesh=None):
    """Causal GQA attention with the implementation named by `impl` (see module docstring).

    `mesh` (neuron_flash only): run the kernel per device over this mesh (default: the ambient
    mesh from `jax.set_mesh`, if any; none = call the kernel on the whole arrays).
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads"
        )
    if kv_mask is not None and kv_mask.shape != q.shape[:2]:
        raise ValueError(f"attention: kv_mask shape {kv_mask.shape} != [B, S] {q.shape[:2]}")
    if impl == "plain":
        return plain_attention(q, k, v, kv_mask)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, kv_mask, block_size=block_size)
    if impl == "flash":
        return flash_attention(q, k, v, kv_mask, block_size=block_size)
    if impl == "neuron_flash":
        if kv_mask is not None:
            raise ValueError(
                "attention='neuron_flash' takes no kv_mask (the NKI kernel has no key mask; "
                "causal masking already hides right-padding): pass kv_mask=None or use "
                "attention='blockwise'"
            )
        return nki_kernels.flash_attention(q, k, v, mesh=mesh)
    raise ValueError(f"attention: impl={impl!r} is not one of {IMPLS}")
