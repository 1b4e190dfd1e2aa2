"""The tied LM head and next-token cross-entropy.

hidden [B, S, D] (after the final norm, compute dtype), embedding [V, D] (the tied token
embedding, float32 parameters), labels int32 [B, S]. Returns the per-token loss float32 [B, S]:
logsumexp(logits) - logits[label], with the log-sum-exp in float32. Masking is the caller's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_logits(hidden, embedding):
    """Logits [B, S, V] in float32 from the tied embedding (matmul in hidden's dtype)."""
    return jnp.einsum(
        "bsd,vd->bsv", hidden, embedding.astype(hidden.dtype), preferred_element_type=jnp.float32
    )


def cross_entropy(hidden, embedding, labels, *, chunk: int | None = None):
    """Per-token next-token cross-entropy, float32 [B, S]. `chunk`: tokens per chunk (None: all)."""
    del chunk  # chunked variant: see the memory issue
    logits = lm_logits(hidden, embedding)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked
