"""The tied LM head and next-token cross-entropy.

hidden [B, S, D] (after the final norm, compute dtype), embedding [V, D] (the tied token
embedding, float32 parameters), labels int32 [B, S]. Returns the per-token loss float32 [B, S]:
logsumexp(logits) - logits[label], with the log-sum-exp in float32. Masking is the caller's.

`chunk` (tokens per chunk, over all B*S tokens of the global batch) computes the LM head and the
loss one chunk at a time in a `lax.scan`; each chunk's body is rematerialised (`jax.checkpoint`),
so neither the forward nor the backward pass ever holds more than one chunk of float32 logits
[chunk, V] (per device: chunk / batch-shards tokens x the local vocabulary shard). The tokens
are laid out strided: chunk c holds tokens c, c + n, c + 2n, ... (n = number of chunks), so a
token axis sharded over the batch axes stays sharded inside every chunk (each device computes
its own rows of each chunk, no data moves; if `chunk` does not divide B*S the padding shifts
rows between devices, which XLA does with small collective-permutes). The label's logit is
picked with a compare-and-sum over the vocabulary (no gather), which XLA partitions over a
vocabulary-sharded embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def lm_logits(hidden, embedding):
    """Logits [B, S, V] in float32 from the tied embedding (matmul in hidden's dtype)."""
    return jnp.einsum(
        "bsd,vd->bsv", hidden, embedding.astype(hidden.dtype), preferred_element_type=jnp.float32
    )


def _loss_from_logits(logits, labels):
    """float32 logits [..., V], labels [...] -> logsumexp - logits[label], float32 [...].

    The label's logit is picked by compare-and-sum (exact: one nonzero term), not a gather, so
    it partitions over a vocabulary-sharded V, also under explicit-sharding meshes.
    """
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab = lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == labels[..., None], logits, 0.0), axis=-1)
    return lse - picked


def _token_loss(hidden, embedding, labels):
    """hidden [T, D], embedding [V, D], labels [T] -> float32 [T]."""
    logits = jnp.einsum(
        "td,vd->tv", hidden, embedding.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    return _loss_from_logits(logits, labels)


def _group_token_loss(hidden, embedding, labels):
    """hidden [G, T, D], embedding [G, V, D] (one copy per token group), labels [G, T] ->
    float32 [G, T]. Group g's logits use copy g only, so the gradient of copy g is group g's
    own sum over its tokens: no reduction across groups until the copies are summed."""
    logits = jnp.einsum(
        "gtd,gvd->gtv", hidden, embedding.astype(hidden.dtype), preferred_element_type=jnp.float32
    )
    return _loss_from_logits(logits, labels)


def cross_entropy(hidden, embedding, labels, *, chunk=None, groups=1, shard=None):
    """Per-token next-token cross-entropy, float32 [B, S]. `chunk`: tokens per chunk (None: all).

    Any `chunk` >= 1 works: the B*S tokens are padded to a multiple of it (the last chunk is
    partial) and the padding is dropped from the result. Exact: the same per-token arithmetic as
    the unchunked loss.

    `groups` (G, dividing the chunk; with `shard(x, dims)` a sharding constraint by logical
    dims): each chunk's tokens are split into G groups, the batch shards, each with its own
    copy of the embedding (`broadcast_to` [G, V, D] float32, sharded over "batch"), so the LM
    head's embedding gradient accumulates over the chunk loop as G per-shard partial sums and
    is summed once, after the loop (the transpose of the broadcast), instead of being reduced
    over the batch axes on every chunk (what XLA does for a replicated [V, D] cotangent).
    """
    if chunk is None:
        return _loss_from_logits(lm_logits(hidden, embedding), labels)
    if chunk < 1:
        raise ValueError(f"cross_entropy: chunk={chunk} must be >= 1 tokens (e.g. 4096) or None")
    b, s, d = hidden.shape
    tokens = b * s
    chunk = min(chunk, tokens)
    n = -(-tokens // chunk)
    pad = n * chunk - tokens
    h = jnp.pad(hidden.reshape(tokens, d), ((0, pad), (0, 0)))
    y = jnp.pad(labels.reshape(tokens), (0, pad))
    # Strided chunks: [chunk, n] keeps the (batch-sharded) leading token axis; scan over n.
    h = h.reshape(chunk, n, d).swapaxes(0, 1)  # [n, chunk, D]
    y = y.reshape(chunk, n).swapaxes(0, 1)  # [n, chunk]
    chunk_loss = jax.checkpoint(_token_loss, prevent_cse=False)
    if groups > 1 and chunk % groups == 0:
        shard = shard or (lambda x, dims: x)
        h = shard(h.reshape(n, groups, chunk // groups, d), (None, "batch", None, None))
        y = y.reshape(n, groups, chunk // groups)
        embedding = shard(
            jnp.broadcast_to(embedding[None], (groups, *embedding.shape)), ("batch", "vocab", None)
        )
        chunk_loss = jax.checkpoint(_group_token_loss, prevent_cse=False)

    def body(carry, xs):
        hc, yc = xs
        return carry, chunk_loss(hc, embedding, yc)

    _, losses = lax.scan(body, None, (h, y))  # [n, chunk] or [n, G, chunk / G]
    losses = losses.reshape(n, chunk)
    return losses.swapaxes(0, 1).reshape(n * chunk)[:tokens].reshape(b, s)
