"""Rotary position embedding (RoPE): the frequencies, their llama3 scaling, and the rotation.

Two pair layouts (`ModelConfig.rope`): "interleaved" pairs (x[2i], x[2i+1]), AXLearn's
convention; "halves" pairs (x[i], x[i + Dh/2]), the GPT-NeoX / Hugging Face Llama ("rotate
half") convention. Pair i turns by position * inv_freq[i] in either layout, so the two differ
only by a fixed permutation of each head's Dh entries (`trn_accum.interop.llama` permutes the
q / k weights between them).

`ModelConfig.rope_scaling = "llama3"` applies the frequency scaling of Llama 3.1 / 3.2 (Hugging
Face transformers `modeling_rope_utils._compute_llama3_parameters`; config.json "rope_scaling":
factor, low_freq_factor, high_freq_factor, original_max_position_embeddings): wavelengths
longer than original_max_len / low_freq_factor are slowed by `factor`, those shorter than
original_max_len / high_freq_factor are kept, and the band between is interpolated.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

ROPE_STYLES = ("interleaved", "halves")
ROPE_SCALINGS = ("none", "llama3")


def inverse_frequencies(cfg) -> jnp.ndarray:
    """float32 [Dh/2]: the angle per position of each pair, theta^(-2i/Dh), llama3-scaled when
    `cfg.rope_scaling` says so. `cfg`: a ModelConfig (head_dim, rope_theta, rope_scaling and
    the rope_* scaling fields)."""
    if cfg.rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"model.rope_scaling {cfg.rope_scaling!r} is not one of {ROPE_SCALINGS}")
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if cfg.rope_scaling == "none":
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x, positions, theta: float, style: str = "interleaved", inv_freq=None):
    """Rotary position embedding. x [B, S, N, Dh], positions int [S] or [B, S].

    Rotates pair i by angle position * inv_freq[i] (default theta^(-2i/Dh); pass
    `inverse_frequencies(cfg)` for a model's, scaling included), in float32; returns x's
    dtype. The pairs (`style`): "interleaved" (x[..., 2i], x[..., 2i+1]), AXLearn's
    convention; "halves" (x[..., i], x[..., i + Dh/2]). Scores q.k of rotated vectors depend
    only on the position difference, in either style.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style {style!r} is not one of {ROPE_STYLES}")
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) S, Dh/2]
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]  # [(B,) S, 1, Dh/2]
    xf = x.astype(jnp.float32)
    if style == "halves":
        x1, x2 = jnp.split(xf, 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    # the pairs by a split of [..., Dh/2, 2] (its gradient is one concatenate, where two strided
    # slices' would be two padded copies and their sum)
    x1, x2 = (p[..., 0] for p in jnp.split(xf.reshape(*x.shape[:-1], half, 2), 2, axis=-1))
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [..., Dh/2, 2]
    return out.reshape(x.shape).astype(x.dtype)
