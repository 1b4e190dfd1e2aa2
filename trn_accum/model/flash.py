"""Flash attention in pure JAX with no loops: `attention(..., impl="flash")`.

Same contract as `trn_accum.model.attention.plain_attention`: q [B, S, H, Dh], k/v [B, S, KV, Dh]
(H % KV == 0, query head h*G + g reads KV head h, G = H // KV; K/V are never repeated), optional
bool `kv_mask` [B, S], causal, softmax in float32 with scale Dh**-0.5, output in q's dtype.

Queries are cut into blocks of `block_size` tokens (the last block may be shorter: S need not be
a multiple). Every loop is a Python loop over static ranges, so the program has no `while`, no
`conditional` and no dynamic-update-slice, and each result block is computed once and written
once (one `concatenate` per result):

- forward, per query block [qs, qe): its scores against the keys it can see, [0, qe), in
  `chunk`-token pieces (0 = one piece) with an online softmax over the pieces; the output block
  and its float32 log-sum-exp (lse) are written once. Keys past the diagonal are never read.
- backward, dq per query block: the same rows, probabilities recomputed from the saved lse, dq
  summed over the pieces of its row in a block-sized float32 value;
- backward, dk and dv per key block [ks, ke): its column, the queries [ks, S), in `chunk`-token
  pieces; dk = dS^T q and dv = P^T dO as one batched dot, summed over the pieces in a
  block-sized float32 value.

Inside, heads lead: q [B, KV, S, G, Dh], k/v [B, KV, S, Dh] (one transpose in, one out), so every
piece is one `dot_general` with batch [B, KV] leading on both sides, G * block (or chunk) rows,
and its result already in the layout the next step reads: no transpose of a score-sized array.
A pass is about S / block large dots. The backward recomputes the scores in both passes (seven
dots per block pair against the five of a pass that accumulates dq across key blocks, as the
Pallas TPU kernels do): the price of writing every gradient block once. Temporary memory per
piece: float32 [B, H, block, min(chunk, S)] scores and their gradient terms, so memory grows with
S * block; an optimization barrier orders the pieces so that one piece's temporaries are live at
a time.

Where a query sees no key at all (every causally visible key masked) the output and its
gradients are zero, as for "blockwise".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Finite, so that a fully masked row gives exp(0) (then zeroed, or uniform in "plain"), never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_F32 = jnp.float32


def _spans(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Static [a, b) pieces of [start, stop), `size` tokens each (the last may be shorter)."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]


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
    """Query block [qs, qe): output [B, KV, nq, G, Dh] (q.dtype), lse [B, KV, nq, G] float32."""
    scale = q.shape[-1] ** -0.5
    qb = _slice(q, qs, qe)
    m = l = acc = None
    for cs, ce in _spans(0, qe, chunk):
        vc = None if valid is None else _slice(valid, cs, ce, 1)
        vis = _visible(qs, qe - qs, cs, ce - cs, vc, keys_first=False)
        s = _dot(qb, _slice(k, cs, ce), ((4,), (3,))) * scale  # [B, KV, nq, G, nk]
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


def _in_sequence(step, spans, args):
    """[step(*args, a, b) for (a, b) in spans], each step after the previous one's result.

    An optimization barrier passes `args` through each result, so no step can start before the
    previous one is done: the temporaries of one step are live at a time (memory S * block, not
    the sum over steps that a scheduler free to interleave them may reach)."""
    results = []
    for a, b in spans:
        out = step(*args, a, b)
        results.append(out)
        args, _ = lax.optimization_barrier((args, out))
    return results


def _flash_forward(q, k, v, valid, block, chunk):
    """q [B, KV, S, G, Dh] -> o [B, KV, S, G, Dh] (q.dtype), lse [B, KV, S, G] float32."""
    step = functools.partial(_row_forward, chunk=chunk)
    rows = _in_sequence(step, _spans(0, q.shape[2], block), (q, k, v, valid))
    o = jnp.concatenate([o for o, _ in rows], axis=2)
    return o, jnp.concatenate([lse for _, lse in rows], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, valid, block, chunk):
    """q [B, KV, S, G, Dh], k/v [B, KV, S, Dh], valid bool [B, S] or None -> [B, KV, S, G, Dh]."""
    return _flash_forward(q, k, v, valid, block, chunk)[0]


def _flash_fwd_rule(q, k, v, valid, block, chunk):
    o, lse = _flash_forward(q, k, v, valid, block, chunk)
    return o, (q, k, v, valid, o, lse)


def _grad_terms(qc, kc, vc, doc, lse_c, delta_c, vis):
    """P and dS * scale of keys kc against queries qc, keys first: [B, KV, nk, nq, G] float32.

    qc, doc [B, KV, nq, G, Dh]; kc, vc [B, KV, nk, Dh]; lse_c, delta_c [B, KV, nq, G]; vis
    keys first. Keys lead, unlike the forward's scores: a dot XLA could identify with the
    forward's would be merged with it (barriers are dropped on some backends), keeping every
    block's scores alive from the forward to the backward."""
    scale = qc.shape[-1] ** -0.5
    s = _dot(kc, qc, ((3,), (4,))) * scale
    p = jnp.exp(s - lse_c[:, :, None])
    p = p if vis is None else jnp.where(vis, p, 0.0)
    dp = _dot(vc, doc, ((3,), (4,)))
    return p, p * (dp - delta_c[:, :, None]) * scale


def _row_dq(q, k, v, valid, do, lse, delta, qs, qe, chunk):
    """dq of query block [qs, qe): float32 [B, KV, nq, G, Dh]."""
    qb, dob, lse_b, delta_b = (_slice(x, qs, qe) for x in (q, do, lse, delta))
    dq = None
    for cs, ce in _spans(0, qe, chunk):
        kc, vc = _slice(k, cs, ce), _slice(v, cs, ce)
        vk = None if valid is None else _slice(valid, cs, ce, 1)
        vis = _visible(qs, qe - qs, cs, ce - cs, vk, keys_first=True)
        _, ds = _grad_terms(qb, kc, vc, dob, lse_b, delta_b, vis)
        part = _dot(ds.astype(k.dtype), kc, ((2,), (2,)))
        dq = part if dq is None else dq + part
    return dq


def _col_dkdv(qdo, k, v, valid, lse, delta, ks, ke, chunk):
    """dk and dv of key block [ks, ke), stacked: float32 [2, B, KV, nk, Dh].

    qdo [2, B, KV, S, G, Dh]: q and dO stacked, so that dk = dS^T q and dv = P^T dO are one
    batched dot (a scheduler cannot then keep P alive for a dv computed later)."""
    kb, vb = _slice(k, ks, ke), _slice(v, ks, ke)
    vk = None if valid is None else _slice(valid, ks, ke, 1)
    dkv = None
    for cs, ce in _spans(ks, qdo.shape[3], chunk):
        qdo_c = _slice(qdo, cs, ce, 3)
        vis = _visible(cs, ce - cs, ks, ke - ks, vk, keys_first=True)
        lse_c, delta_c = _slice(lse, cs, ce), _slice(delta, cs, ce)
        p, ds = _grad_terms(qdo_c[0], kb, vb, qdo_c[1], lse_c, delta_c, vis)
        terms = jnp.stack([ds, p]).astype(qdo.dtype)  # [2, B, KV, nk, nq, G]
        part = _dot(terms, qdo_c, ((4, 5), (3, 4)), batch=3)
        dkv = part if dkv is None else dkv + part
    return dkv


def _flash_bwd_rule(block, chunk, res, d_out):
    """dq by query block (rows), dk and dv by key block (columns); each block written once."""
    # The barrier keeps XLA from merging this recomputation with the forward's scores (which
    # would keep every block's scores alive from the forward to here), as jax.checkpoint does.
    q, k, v, valid, o, lse = lax.optimization_barrier(res)
    do = d_out.astype(o.dtype)  # [B, KV, S, G, Dh]
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)  # [B, KV, S, G]
    blocks = _spans(0, q.shape[2], block)
    row_args = (q, k, v, valid, do, lse, delta)
    dq = jnp.concatenate(_in_sequence(functools.partial(_row_dq, chunk=chunk), blocks, row_args), 2)
    col_args = (jnp.stack([q, do]), k, v, valid, lse, delta)
    col_args, _ = lax.optimization_barrier((col_args, dq))  # the columns after the rows
    cols = _in_sequence(functools.partial(_col_dkdv, chunk=chunk), blocks, col_args)
    dkv = jnp.concatenate(cols, axis=3)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def flash_attention(q, k, v, kv_mask=None, *, block_size: int = 512, chunk: int = 0):
    """Causal GQA flash attention, loop-free (see module docstring); `plain_attention`'s contract.

    q [B, S, H, Dh], k/v [B, S, KV, Dh], kv_mask bool [B, S] or None -> [B, S, H, Dh].
    `block_size`: tokens per query block (rows) and key block (columns), clamped to S.
    `chunk`: tokens of the long side (keys of a row, queries of a column) per dot; 0 = all.
    """
    if block_size < 1:
        raise ValueError(f"attention: block_size={block_size} must be >= 1 (e.g. 512)")
    if chunk < 0:
        raise ValueError(f"attention: chunk={chunk} must be >= 0 (0 = whole rows and columns)")
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    heads_first = q.reshape(b, s, kvh, h // kvh, dh).transpose(0, 2, 1, 3, 4)
    k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))
    valid = None if kv_mask is None else kv_mask.astype(bool)
    out = _flash(heads_first, k, v, valid, min(block_size, s), chunk or s)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, s, h, dh)
