"""Attention alone, forward + backward, on the machine it runs on: ms and share of peak (issue 45).

    python3 benchmarks/attention.py                    # S 2048 and 8192, B=1, 24/8 heads of 128
    python3 benchmarks/attention.py --seq 8192 --flash 512 1024 512:2048
    python3 benchmarks/attention.py --seq 256 --platform tpu-v5e   # a quick check on a CPU
    python3 benchmarks/attention.py --seq 8192 --heads 12 --kv-heads 4 --counters --no-xla
        # no timing: the step-time model's counters of each program (the 3B's per-device heads)

From the repository root with the package importable (PYTHONPATH=.). Each row times one jitted
program that returns the output and the gradients of q, k and v for a fixed cotangent (causal,
`--dtype` inputs): the median of `--runs` runs after one warm-up run, each ended by
`jax.block_until_ready`. Rows:

- `blockwise B`: `attention(impl="blockwise", block_size=B)` (the pair scan);
- `flash B[:C]`: `attention(impl="flash")` with query block B and chunk C of the keys left of
  a block (`trn_accum.model.flash`; no C = all of them in one dot);
- `xla`: `jax.nn.dot_product_attention(is_causal=True)` (XLA's own, GQA native);
- `pallas B` (on a TPU only, the reference): `jax.experimental.pallas.ops.tpu.flash_attention`
  with every block B (clamped to S), K/V repeated to the query heads inside the timed program
  (it takes no grouped heads).

`--counters` compiles each row instead of timing it and prints what the step-time model reads
from its module (`trn_accum.analysis.pricing.op_features`): dot FLOPs, the bytes of kernels and
elementwise ops (`kernel_bytes + elementwise_bytes + loop_elementwise_bytes`), loop iterations,
the peak live bytes the dry-run's fit estimates (`trn_accum.analysis.live_bytes`), and the
model's price of those counters on `--platform` (what the dry-run would charge the row inside a
step; set it beside the chip's time of the same row). Nothing is allocated: the inputs are
shapes only, so S 8192 runs on a laptop.

Share of peak: the project's FLOP count (`trn_accum.train.flops.flops_per_step`, causal attention
of one layer: 6 H Dh S^2 per sequence) over the time, against `--platform`'s peak dense FLOP/s
(`trn_accum.analysis.platforms`; on a TPU v5e, 197e12). On a CPU the share is against that
platform's peak too, so only the times mean anything there. The last column, "FA2 count", is the
same time against FlashAttention's own benchmark count (Dao-AILab/flash-attention,
benchmarks/benchmark_flash_attention.py: forward 4 S^2 H Dh / 2 when causal, backward 2.5 times
that, its recomputed scores included): 7 H Dh S^2, 7/6 of ours. Issue 45's attention table is in
that count.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.accumulation import median_runtime
from trn_accum.analysis import platforms
from trn_accum.config.load import Config, DataConfig, ModelConfig
from trn_accum.model.attention import attention
from trn_accum.model.flash import flash_attention
from trn_accum.train.flops import flops_per_step

#: FlashAttention's benchmark count of a causal forward + backward (7 H Dh S^2 per sequence: the
#: backward's recomputed scores counted) over the trainer's (6 H Dh S^2).
FA2_PER_OURS = 7 / 6


def attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
    """FLOPs of one causal attention, forward + backward, as the trainer's MFU counts them."""
    model = ModelConfig(
        num_layers=1, num_heads=heads, head_dim=head_dim, hidden_dim=heads * head_dim
    )
    cfg = Config(model=model, data=DataConfig(seq_len=seq, global_batch=batch))
    return flops_per_step(cfg)["attention"]


def _flash_spec(text: str) -> tuple[int, int]:
    """'512' -> (512, 0); '512:2048' -> (512, 2048): block and chunk of a flash row."""
    block, _, chunk = text.partition(":")
    return int(block), int(chunk or 0)


def _pallas(block: int):
    """The Pallas TPU flash attention as a [B, S, H, Dh] -> [B, S, H, Dh] function (K/V
    repeated to the query heads), or None off a TPU."""
    if jax.devices()[0].platform != "tpu":
        return None
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_fa

    def fn(q, k, v):
        b, s, h, dh = q.shape
        n = min(block, s)
        names = ("q", "k_major", "k", "q_major_dkv", "k_major_dkv", "k_dkv", "q_dkv")
        names += ("k_major_dq", "k_dq", "q_dq")
        sizes = pallas_fa.BlockSizes(block_b=1, **{f"block_{name}": n for name in names})
        rep = h // k.shape[2]
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
        out = pallas_fa.flash_attention(q, k, v, causal=True, sm_scale=dh**-0.5, block_sizes=sizes)
        return out.transpose(0, 2, 1, 3)

    return fn


def candidates(args) -> list[tuple[str, object]]:
    """(row name, fn(q, k, v) -> out) for every row asked for, in table order."""
    rows = [
        (f"blockwise {b}", functools.partial(attention, impl="blockwise", block_size=b))
        for b in args.blockwise
    ]
    for spec in args.flash:
        b, c = _flash_spec(spec)
        rows.append((f"flash {spec}", functools.partial(flash_attention, block_size=b, chunk=c)))
    if not args.no_xla:
        rows.append(("xla", functools.partial(jax.nn.dot_product_attention, is_causal=True)))
    for b in args.pallas:
        fn = _pallas(b)
        if fn is not None:
            rows.append((f"pallas {b}", fn))
    return rows


def fwd_bwd(fn):
    """(q, k, v, ct) -> (out, (dq, dk, dv)): `fn` and its VJP at `ct`, jitted."""

    def step(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct)

    return jax.jit(step)


def time_fwd_bwd(fn, inputs, runs: int) -> float:
    """Median seconds of `fwd_bwd(fn)` on `inputs`, after one warm-up run."""
    return median_runtime(fwd_bwd(fn), inputs, runs, warmup=1)


def counters(fn, inputs, platform: str = "tpu-v5e") -> dict:
    """The step-time model's counters of `fn`'s forward + backward on `inputs`' shapes, and
    "priced_s": the model's seconds for them on `platform` (`trn_accum.analysis.pricing`, the
    platform's efficiency and op rates, as the dry-run prices a step's ops)."""
    from trn_accum.analysis import pricing
    from trn_accum.analysis.hlo.module import parse_hlo
    from trn_accum.analysis.hlo.partitioned import compile_partitioned
    from trn_accum.analysis.live_bytes import peak_live_bytes

    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
    _, text = compile_partitioned(fwd_bwd(fn).lower(*shapes))
    plat = platforms.get(platform)
    eff = plat.efficiency
    f = pricing.op_features(parse_hlo(text), eff.tile, eff.rates, eff.onchip_bytes)
    moved = f["kernel_bytes"] + f["elementwise_bytes"] + f["loop_elementwise_bytes"]
    return {
        "dot_flops": f["dot_flops"],
        "bytes": moved,
        "loop_iterations": f["loop_iterations"],
        "live_bytes": peak_live_bytes(text),
        "priced_s": pricing.price(f, plat.peak_flops, plat.hbm_bytes_s, eff)["total_s"],
    }


def make_inputs(args, seq: int):
    """q, k, v, ct: [B, S, H|KV, Dh] normal, in --dtype."""
    dt = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    return [
        jax.random.normal(key, (args.batch, seq, h, args.head_dim), jnp.float32).astype(dt)
        for key, h in zip(keys, heads, strict=True)
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--blockwise", type=int, nargs="*", default=[512, 1024])
    p.add_argument(
        "--flash", nargs="*", default=["256", "512", "1024", "512:2048"], metavar="BLOCK[:CHUNK]"
    )
    p.add_argument("--pallas", type=int, nargs="*", default=[1024], help="TPU only")
    p.add_argument("--no-xla", action="store_true", help="leave out jax.nn.dot_product_attention")
    p.add_argument("--platform", choices=sorted(platforms.PLATFORMS), default="tpu-v5e")
    p.add_argument("--counters", action="store_true", help="print the model's counters, no timing")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    for spec in args.flash:
        try:
            _flash_spec(spec)
        except ValueError:
            p.error(f"--flash {spec!r}: want BLOCK or BLOCK:CHUNK, e.g. 512 or 512:2048")
    return args


def main(argv=None) -> list[dict]:
    """Print the table; return its rows (seq, name, ms, share)."""
    args = parse_args(argv)
    if args.counters:
        return print_counters(args)
    peak = platforms.get(args.platform).peak_flops
    device = jax.devices()[0]
    print(
        f"attention fwd+bwd on {device.platform} ({device.device_kind}): B={args.batch}, "
        f"{args.heads} query / {args.kv_heads} KV heads, head dim {args.head_dim}, "
        f"{args.dtype}, causal; median of {args.runs}; share of {args.platform} peak "
        f"{peak:.3g} FLOP/s"
    )
    print(
        f"{'S':>6} | {'implementation':<16} | {'ms':>9} | {'TFLOP/s':>8} | share of peak"
        " | FA2 count"
    )
    rows = []
    for seq in args.seq:
        inputs = make_inputs(args, seq)
        flops = attention_flops(args.batch, seq, args.heads, args.head_dim)
        for name, fn in candidates(args):
            sec = time_fwd_bwd(fn, inputs, args.runs)
            share = flops / sec / peak
            fa2 = share * FA2_PER_OURS
            rows.append({"seq": seq, "name": name, "ms": sec * 1e3, "share": share, "fa2": fa2})
            line = f"{seq:>6} | {name:<16} | {sec * 1e3:>9.2f} | {flops / sec / 1e12:>8.2f}"
            print(f"{line} | {share:>13.3g} | {fa2:.3g}", flush=True)
    return rows


def print_counters(args) -> list[dict]:
    """The --counters table; its rows (seq, name and `counters`' keys)."""
    print(
        f"{'S':>6} | {'implementation':<16} | dot FLOPs | kernel+elementwise bytes | loops | live"
        f" | {args.platform} priced ms"
    )
    rows = []
    for seq in args.seq:
        inputs = [
            jax.ShapeDtypeStruct((args.batch, seq, h, args.head_dim), jnp.dtype(args.dtype))
            for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
        ]
        for name, fn in candidates(args):
            c = counters(fn, inputs, args.platform)
            rows.append({"seq": seq, "name": name, **c})
            print(
                f"{seq:>6} | {name:<16} | {c['dot_flops']:.3e} | {c['bytes']:.3e} | "
                f"{c['loop_iterations']:.0f} | {c['live_bytes']:.3e} | {c['priced_s'] * 1e3:.2f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
