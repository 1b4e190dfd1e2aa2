"""Flash attention in pure JAX with no loops: `attention(..., impl="flash")`.

Same contract as `trn_accum.model.attention.plain_attention`: q [B, S, H, Dh], k/v [B, S, KV, Dh]
(H % KV == 0, query head h*G + g reads KV head h, G = H // KV; K/V are never repeated), optional
bool `kv_mask` [B, S], causal, softmax in float32, output in q's dtype.

The queries are scaled by Dh**-0.5 once before any dot (in float32, rounded once to their
dtype; AXLearn's attention scales its query projection, Flax's `dot_product_attention_weights`
its query, the same way): no score-sized multiply in either pass. Queries are cut into blocks
of `block_size` tokens (the last may be shorter: S need not be a multiple). Every loop is a
Python loop over static ranges, so the program has no `while`, no `conditional` and no
dynamic-update-slice:

- forward, per query block [qs, qe): its scores against the keys left of the block, [0, qs),
  in `chunk`-token pieces (0 = one piece) that need no mask, then against the block's own
  keys [qs, qe) under the causal mask, with an online softmax over the pieces; the output block
  and its float32 log-sum-exp (lse) are written once. Keys past the diagonal are never read.
- backward, one pass over the same rows and pieces: the probabilities recomputed from the saved
  lse, dS = P (dP - delta); dq of the row summed over its pieces and written once, each
  piece's dk = dS^T q and dv = P^T dO added to the sums of the key spans it covers (block-sized
  float32 values, never a whole-sequence buffer), concatenated once at the end. Five dots per
  piece (the scores, dP, dq, dk, dv; the forward has two), as the Pallas TPU kernels do: each
  piece's scores are computed once per pass.

Inside, heads lead: q [B, KV, S, G, Dh], k/v [B, KV, S, Dh] (one transpose in, one out), so every
piece is one `dot_general` with batch [B, KV] leading on both sides, G * block (or chunk) rows,
and its result already in the layout the next step reads: no transpose of a score-sized array.
Temporary memory per piece: float32 [B, H, block, min(chunk, S)] scores and their gradient terms,
so memory grows with S * block; an optimization barrier orders the rows so that one row's
temporaries are live at a time, where the backend schedules with the barriers in place (XLA:CPU
removes them first, its OptimizationBarrierExpander, and its footprint grows faster).

Where a query sees no key at all (every causally visible key masked) the output and its
gradients are zero, as for "blockwise".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# Finite, so that a fully masked row gives exp(0) (then zeroed, or uniform in "plain"), never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_F32 = jnp.float32

#: The names of what the attention's backward reads besides its inputs, its output and float32
#: log-sum-exp (flash and blockwise): a remat policy that saves them
#: (`jax.checkpoint_policies.save_only_these_names`) spares the backward a second forward pass.
RESIDUAL_NAMES = ("attention_out", "attention_lse")


def name_residuals(o, lse):
    """(o, lse) named `RESIDUAL_NAMES` for remat policies."""
    return checkpoint_name(o, RESIDUAL_NAMES[0]), checkpoint_name(lse, RESIDUAL_NAMES[1])


def _spans(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Static [a, b) pieces of [start, stop), `size` tokens each (the last may be shorter)."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


def _pieces(qs: int, qe: int, chunk: int) -> list[tuple[int, int]]:
    """The key pieces of query block [qs, qe): [0, qs) in `chunk`-token spans, then [qs, qe)."""
    return [*_spans(0, qs, chunk), (qs, qe)]


def _slice(x, start, stop, axis=2):
    return lax.slice_in_dim(x, start, stop, axis=axis)


def _dot(lhs, rhs, contract: tuple[tuple[int, ...], tuple[int, ...]], batch: int = 2):
    """float32 dot_general over the first `batch` dims of both operands (leading in the result,
    then lhs's free dims, then rhs's)."""
    dims = (contract, (tuple(range(batch)), tuple(range(batch))))
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=_F32)


def _visible(q_start: int, nq: int, k_start: int, nk: int, valid, keys_first: bool):
    """Key k_start + t visible to query q_start + r, or None when every pair is; bool
    [B|1, 1, nq, 1, nk], or [B|1, 1, nk, nq, 1] when `keys_first` (broadcasting over KV and G).
    `valid`: bool [B, nk] for these keys, or None."""
    vis = None
    if k_start + nk - 1 > q_start:  # some key lies right of some query: causal mask needed
        r = lax.broadcasted_iota(jnp.int32, (nq, nk), 0) + q_start
        t = lax.broadcasted_iota(jnp.int32, (nq, nk), 1) + k_start
        vis = (t <= r)[None]
    if valid is not None:
        vis = valid[:, None, :] if vis is None else vis & valid[:, None, :]
    if vis is None:
        return None
    return vis.swapaxes(1, 2)[:, None, :, :, None] if keys_first else vis[:, None, :, None, :]


def _row_forward(q, k, v, valid, qs, qe, chunk):
    """Query block [qs, qe) of the scaled queries: output [B, KV, nq, G, Dh] (q.dtype), lse
    [B, KV, nq, G] float32."""
    qb = _slice(q, qs, qe)
    m = l = acc = None
    for cs, ce in _pieces(qs, qe, chunk):
        vc = None if valid is None else _slice(valid, cs, ce, 1)
        vis = _visible(qs, qe - qs, cs, ce - cs, vc, keys_first=False)
        s = _dot(qb, _slice(k, cs, ce), ((4,), (3,)))  # [B, KV, nq, G, nk]
        if vis is not None:
            s = jnp.where(vis, s, MASK_VALUE)
        m_new = s.max(axis=-1) if m is None else jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if valid is not None:  # a query whose keys are all masked so far has m = MASK_VALUE
            p = jnp.where(vis, p, 0.0)
        pv = _dot(p.astype(v.dtype), _slice(v, cs, ce), ((4,), (2,)))  # [B, KV, nq, G, Dh]
        if m is None:
            l, acc = p.sum(axis=-1), pv
        else:
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + pv
        m = m_new
    l_safe = jnp.where(l > 0.0, l, 1.0)
    return (acc / l_safe[..., None]).astype(q.dtype), m + jnp.log(l_safe)


def _flash_forward(q, k, v, valid, block, chunk):
    """q [B, KV, S, G, Dh] (scaled) -> o [B, KV, S, G, Dh] (q.dtype), lse [B, KV, S, G] f32."""
    args, rows = (q, k, v, valid), []
    for qs, qe in _spans(0, q.shape[2], block):
        out = _row_forward(*args, qs, qe, chunk)
        rows.append(out)
        args, _ = lax.optimization_barrier((args, out))  # the next row after this one
    o = jnp.concatenate([o for o, _ in rows], axis=2)
    return o, jnp.concatenate([lse for _, lse in rows], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, valid, block, chunk):
    """q [B, KV, S, G, Dh] (scaled), k/v [B, KV, S, Dh], valid bool [B, S] or None ->
    [B, KV, S, G, Dh]."""
    return _flash_forward(q, k, v, valid, block, chunk)[0]


def _flash_fwd_rule(q, k, v, valid, block, chunk):
    o, lse = name_residuals(*_flash_forward(q, k, v, valid, block, chunk))
    return o, (q, k, v, valid, o, lse)


def _row_grads(q, k, v, valid, do, lse, delta, qs, qe, chunk):
    """Query block [qs, qe): its dq, float32 [B, KV, nq, G, Dh], and per key piece [cs, ce)
    (cs, dk, dv), float32 [B, KV, nk, Dh] each.

    Keys lead in the recomputed scores ([B, KV, nk, nq, G], unlike the forward's): a dot XLA
    could identify with the forward's would be merged with it (barriers are dropped on some
    backends), keeping every block's scores alive from the forward to the backward."""
    qb, dob, lse_b, delta_b = (_slice(x, qs, qe) for x in (q, do, lse, delta))
    dq, parts = None, []
    for cs, ce in _pieces(qs, qe, chunk):
        kc, vc = _slice(k, cs, ce), _slice(v, cs, ce)
        vk = None if valid is None else _slice(valid, cs, ce, 1)
        vis = _visible(qs, qe - qs, cs, ce - cs, vk, keys_first=True)
        p = jnp.exp(_dot(kc, qb, ((3,), (4,))) - lse_b[:, :, None])
        p = p if vis is None else jnp.where(vis, p, 0.0)
        ds = (p * (_dot(vc, dob, ((3,), (4,))) - delta_b[:, :, None])).astype(q.dtype)
        part = _dot(ds, kc, ((2,), (2,)))
        dq = part if dq is None else dq + part
        dk = _dot(ds, qb, ((3, 4), (2, 3)))
        dv = _dot(p.astype(do.dtype), dob, ((3, 4), (2, 3)))
        parts.append((cs, dk, dv))
    return dq, parts


def _add_spans(sums: dict, cuts: list[int], start: int, dk, dv) -> dict:
    """`sums` {span start: (dk, dv)} with the piece (dk, dv) of keys [start, start + nk) added
    span by span (`cuts`: the span boundaries, every piece boundary among them)."""
    stop = start + dk.shape[2]
    out = dict(sums)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if a < start or b > stop:
            continue
        piece = (_slice(dk, a - start, b - start), _slice(dv, a - start, b - start))
        out[a] = piece if a not in out else (out[a][0] + piece[0], out[a][1] + piece[1])
    return out


def _flash_bwd_rule(block, chunk, res, d_out):
    """One pass over the rows: dq per row, dk and dv summed per key span; each written once."""
    # The barrier keeps XLA from merging this recomputation with the forward's scores (which
    # would keep every block's scores alive from the forward to here), as jax.checkpoint does.
    q, k, v, valid, o, lse = lax.optimization_barrier(res)
    do = d_out.astype(o.dtype)  # [B, KV, S, G, Dh]
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)  # [B, KV, S, G]
    s = q.shape[2]
    rows = _spans(0, s, block)
    cuts = sorted({0, s, *(b for _, b in rows), *range(0, s, chunk)})
    args, sums, dq = (q, k, v, valid, do, lse, delta), {}, []
    for qs, qe in rows:
        dq_row, parts = _row_grads(*args, qs, qe, chunk)
        for cs, dk, dv in parts:
            sums = _add_spans(sums, cuts, cs, dk, dv)
        dq.append(dq_row)
        (args, sums), _ = lax.optimization_barrier(((args, sums), dq_row))  # rows in order
    dk = jnp.concatenate([sums[a][0] for a in cuts[:-1]], axis=2)
    dv = jnp.concatenate([sums[a][1] for a in cuts[:-1]], axis=2)
    return jnp.concatenate(dq, axis=2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def flash_attention(q, k, v, kv_mask=None, *, block_size: int = 512, chunk: int = 0):
    """Causal GQA flash attention, loop-free (see module docstring); `plain_attention`'s contract.

    q [B, S, H, Dh], k/v [B, S, KV, Dh], kv_mask bool [B, S] or None -> [B, S, H, Dh].
    `block_size`: tokens per query block (rows), clamped to S.
    `chunk`: tokens per piece of the keys left of a row's block; 0 = all of them at once.
    """
    if block_size < 1:
        raise ValueError(f"attention: block_size={block_size} must be >= 1 (e.g. 512)")
    if chunk < 0:
        raise ValueError(f"attention: chunk={chunk} must be >= 0 (0 = all keys left of a block)")
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    scaled = (q.astype(_F32) * dh**-0.5).astype(q.dtype)  # rounded once, scale exact
    heads_first = scaled.reshape(b, s, kvh, h // kvh, dh).transpose(0, 2, 1, 3, 4)
    k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))
    valid = None if kv_mask is None else kv_mask.astype(bool)
    out = _flash(heads_first, k, v, valid, min(block_size, s), chunk or s)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, s, h, dh)
