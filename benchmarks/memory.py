"""Compiled temporary memory of attention and the LM-head loss, forward + backward.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/memory.py

Compile only (abstract `jax.ShapeDtypeStruct` inputs, nothing executes): `memory_analysis()`
temp bytes of `vjp(f)(cotangent)` on one CPU device. Shapes are one trn2 logical core's share of
Fuji 3B with tensor parallelism 4: 24/4 = 6 query heads, 8/4 = 2 KV heads, head dim 128, one
sequence, bfloat16 activations; the loss uses the full 131072 vocabulary and hidden 3072 (one
8192-token sequence). CPU temp bytes are a proxy (XLA:CPU computes bf16 dots in float32), not a
fit check for trn2. The analytic column is one float32 score / logit buffer: [H, S, S] for plain
attention, one [H, block, block] block for blockwise, [tokens or chunk, V] for the loss.

The chunked loss keeps a floor of about 2.5 x [V, D] float32 whatever the chunk (3.75 GiB at
V=131072, D=3072): the float32 embedding-gradient accumulator of the chunk loop, one chunk's
[V, D] contribution to it, and the bfloat16 copy of the embedding. That floor does not grow with
tokens (and shrinks with a vocabulary-sharded embedding), the logits do: plain grows with tokens,
chunked stays flat (compare the 8192- and 32768-token rows).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from trn_accum.model.attention import attention
from trn_accum.model.xent import cross_entropy

GiB = 2**30


def _temp_bytes(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def attention_rows(seqs, heads=6, kv_heads=2, head_dim=128, blocks=(512, 1024)):
    rows = []
    for s in seqs:
        q = jax.ShapeDtypeStruct((1, s, heads, head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, s, kv_heads, head_dim), jnp.bfloat16)
        base = None
        for impl, block in [("plain", None), *(("blockwise", b) for b in blocks)]:

            def fwd_bwd(q, k, v, ct, impl=impl, block=block):
                f = lambda q, k, v: attention(q, k, v, impl=impl, block_size=block or 512)  # noqa: E731
                _, vjp = jax.vjp(f, q, k, v)
                return vjp(ct)

            temp, secs = _temp_bytes(fwd_bwd, q, kv, kv, q)
            base = base or temp
            name = impl if block is None else f"{impl} (block {block})"
            scores = heads * s * s * 4 if block is None else heads * block * block * 4
            rows.append((f"attention S={s}", name, temp, base / temp, scores, secs))
    return rows


def loss_rows(tokens=8192, hidden=3072, vocab=131072, chunks=(4096, 2048, 1024)):
    h = jax.ShapeDtypeStruct((1, tokens, hidden), jnp.bfloat16)
    emb = jax.ShapeDtypeStruct((vocab, hidden), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    ct = jax.ShapeDtypeStruct((1, tokens), jnp.float32)
    rows, base = [], None
    for chunk in (None, *chunks):

        def fwd_bwd(h, e, y, ct, chunk=chunk):
            _, vjp = jax.vjp(lambda h, e: cross_entropy(h, e, y, chunk=chunk), h, e)
            return vjp(ct)

        temp, secs = _temp_bytes(fwd_bwd, h, emb, labels, ct)
        base = base or temp
        name = "plain" if chunk is None else f"chunk {chunk}"
        logits = (chunk or tokens) * vocab * 4
        rows.append((f"loss T={tokens} V={vocab}", name, temp, base / temp, logits, secs))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    args = parser.parse_args(argv)
    rows = attention_rows(args.seqs)
    rows += loss_rows(tokens=8192, chunks=(4096, 1024, 256))  # one sequence
    rows += loss_rows(tokens=4 * 8192, chunks=(1024,))  # four sequences on one device
    header = ("case", "impl", "temp GiB", "x less", "f32 scores/logits GiB", "compile s")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, forward + backward")
    print(
        f"{header[0]:<26}{header[1]:<24}{header[2]:>10}{header[3]:>8}{header[4]:>23}{header[5]:>11}"
    )
    for case, impl, temp, ratio, analytic, secs in rows:
        print(
            f"{case:<26}{impl:<24}{temp / GiB:>10.3f}{ratio:>8.1f}{analytic / GiB:>23.3f}"
            f"{secs:>11.1f}"
        )


if __name__ == "__main__":
    main()
