"""The analytic FLOP count of one training step of the Fuji model (the MFU's numerator; the
trainer's log, the dry-run and the step-time model read it here)."""

from __future__ import annotations

from trn_accum.config.load import Config
from trn_accum.model import fuji


def flops_per_step(cfg: Config, global_batch: int | None = None) -> dict[str, float]:
    """Analytic training FLOPs of one optimizer step (forward + backward, no remat recompute).

    dense = 6 * N * tokens (N counts the tied embedding once: the LM head matmul uses it);
    attention = 6 * L * H * Dh * S per token (QK^T and PV, causal: half of the 12 L H Dh S of
    non-causal attention).
    """
    m = cfg.model
    b = cfg.data.global_batch if global_batch is None else global_batch
    s = cfg.data.seq_len
    tokens = b * s
    n = fuji.num_params(m)
    dense = 6.0 * n * tokens
    attn = 6.0 * m.num_layers * m.num_heads * m.head_dim * s * tokens
    return {"params": n, "tokens": tokens, "dense": dense, "attention": attn, "total": dense + attn}
