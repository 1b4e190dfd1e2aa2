"""What single ops achieve on the machine this runs on: the rates the step-time model prices dots,
unfused kernels and loop iterations at (`trn_accum.analysis.rates`; issue 46, part 2).

    python3 benchmarks/op_rates.py --out rates.json            # the whole grid (about 3 min on
                                                              # a TPU v5e)
    python3 benchmarks/op_rates.py --quick                     # a few shapes (a check on a CPU)

From the repository root with the package importable (PYTHONPATH=.). Rows, each timed inside one
jitted program that runs the op `reps` times in a `lax.fori_loop` (so no dispatch between them;
the median of `--runs` calls after a warm-up call, each ended by `jax.block_until_ready`),
seconds per op = call time / reps:

- `dot`: `c = c + a @ b` in bf16, a [batch, m, k], b [batch, k, n] (batch 1: plain matrices),
  float32 accumulation inside the dot; the efficiency is 2 x batch x m x n x k over the time
  at `--platform`'s peak dense FLOP/s. The operands pass through `lax.optimization_barrier`
  each iteration: without it XLA hoists the loop-invariant product out of the loop (the first
  run on the chip reported 20x peak).
- `stream`: `x = x * s + t` over a bf16 vector of `--stream-mib` MiB: bytes read + written per
  second, against `--platform`'s HBM bandwidth.
- `loop`: a loop whose body adds one to a scalar: the fixed cost of an iteration.

The shapes: every (m, n, k) of powers of 4 from 128 to 8192 (the widths, sequence blocks and
vocab slices of a Fuji step fall between), and the batched products of attention (24 and 8
heads: [S, 128] x [128, S] and [S, S] x [S, 128] blocks, S 512-2048). A printed line per row,
then the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.accumulation import median_runtime
from trn_accum.analysis import platforms

GRID = (128, 512, 2048, 8192)
#: (batch, m, n, k) of the attention products: scores q k^T, then probabilities x v.
BATCHED = tuple(
    shape
    for s in (512, 1024, 2048)
    for shape in ((24, s, s, 128), (24, s, 128, s), (8, s, s, 128), (8, s, 128, s))
)
QUICK = ((1, 128, 128, 128), (1, 512, 512, 512), (8, 256, 256, 128))
TARGET_S = 0.03


def _reps(estimate_s: float, max_reps: int) -> int:
    return int(min(max_reps, max(2, TARGET_S / max(estimate_s, 2e-6))))


def dot_row(batch: int, m: int, n: int, k: int, plat, runs: int, max_reps: int = 2000) -> dict:
    """One batched product's seconds and efficiency (see the module docstring)."""
    flops = 2.0 * batch * m * n * k
    nbytes = 2 * batch * (m * k + k * n + 2 * m * n)
    est = max(flops / (0.7 * plat.peak_flops), nbytes / (0.7 * plat.hbm_bytes_s))
    reps = _reps(est, max_reps)
    key = jax.random.key(0)
    a = jax.random.normal(key, (batch, m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (batch, k, n), jnp.bfloat16)
    c = jnp.zeros((batch, m, n), jnp.bfloat16)

    @jax.jit
    def run(a, b, c):
        def body(_, carry):
            # The barrier keeps XLA from hoisting the loop-invariant product out of the loop.
            a, b, c = lax.optimization_barrier(carry)
            p = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=jnp.float32)
            return a, b, c + p.astype(jnp.bfloat16)

        return lax.fori_loop(0, reps, body, (a, b, c))[2]

    t = median_runtime(run, (a, b, c), runs, warmup=1) / reps
    return {
        "op": "dot",
        "batch": batch,
        "m": m,
        "n": n,
        "k": k,
        "reps": reps,
        "seconds": t,
        "efficiency": flops / (t * plat.peak_flops),
        "bandwidth_share": nbytes / (t * plat.hbm_bytes_s),
    }


def stream_row(mib: int, plat, runs: int, max_reps: int = 2000) -> dict:
    """An elementwise pass over `mib` MiB of bf16: read + written bytes per second."""
    n = mib * 2**20 // 2
    nbytes = 2 * 2 * n
    reps = _reps(nbytes / (0.7 * plat.hbm_bytes_s), max_reps)
    x = jnp.ones((n,), jnp.bfloat16)

    @jax.jit
    def run(x):
        return lax.fori_loop(0, reps, lambda _, x: lax.optimization_barrier(x) * 0.5 + 0.25, x)

    t = median_runtime(run, (x,), runs, warmup=1) / reps
    return {
        "op": "stream",
        "mib": mib,
        "reps": reps,
        "seconds": t,
        "bandwidth_share": nbytes / (t * plat.hbm_bytes_s),
    }


def loop_row(runs: int, reps: int = 20000) -> dict:
    """The fixed cost of one `while` iteration (a body of one scalar add)."""

    @jax.jit
    def run(x):
        return lax.fori_loop(0, reps, lambda _, x: x + 1, x)

    t = median_runtime(run, (jnp.zeros((), jnp.int32),), runs, warmup=1) / reps
    return {"op": "loop", "reps": reps, "seconds": t}


def shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    if quick:
        return list(QUICK)
    return [(1, m, n, k) for m, n, k in itertools.product(GRID, repeat=3)] + list(BATCHED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", default="tpu-v5e", help="peak FLOP/s and HBM bytes/s")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stream-mib", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="three small shapes, 20 reps at most")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    max_reps = 20 if args.quick else 2000
    plat = platforms.get(args.platform)
    device = jax.devices()[0].device_kind
    rows = [stream_row(64 if args.quick else args.stream_mib, plat, args.runs, max_reps)]
    rows.append(loop_row(args.runs, reps=20 if args.quick else 20000))
    for r in rows:
        print(json.dumps(r), flush=True)
    for batch, m, n, k in shapes(args.quick):
        row = dot_row(batch, m, n, k, plat, args.runs, max_reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {
        "device": device,
        "jax": jax.__version__,
        "platform": args.platform,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python3 benchmarks/op_rates.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
