"""Causal grouped-query attention kernels.

Shapes: q [B, S, H, Dh]; k, v [B, S, KV, Dh] with H % KV == 0 (query heads h*G ... h*G+G-1
share KV head h, G = H // KV). Output [B, S, H, Dh] in q's dtype. Softmax in float32.
`kv_mask` (optional, bool [B, S]): False marks a padded key position that no query may attend to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so that a query with no visible key yields a uniform (not NaN) row.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

IMPLS = ("plain",)


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


def attention(q, k, v, *, impl: str = "plain", block_size: int = 512, kv_mask=None):
    """Causal GQA attention with the implementation named by `impl` (see module docstring)."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} KV heads"
        )
    if impl == "plain":
        return plain_attention(q, k, v, kv_mask)
    raise ValueError(f"attention: impl={impl!r} is not one of {IMPLS}")
