"""Sequences per second of the host data path at seq 8192: a Megatron corpus read in place,
and a 3-way mixture, against what a trn2 node consumes at the 3B config's predicted step time.

    nice -n 10 .venv/bin/python benchmarks/data_throughput.py               # 2 GB, /tmp
    .venv/bin/python benchmarks/data_throughput.py --gb 0.2 --seconds 3     # quick look

Writes under --dir (a fresh temporary directory by default, deleted at the end unless --keep)
a Megatron .bin/.idx pair of --gb GB of uint16 tokens (documents of 200-20,000 tokens, the
index laid out as megatron-core's IndexedDatasetBuilder writes it), and two more corpora of a
quarter of that size each for the mixture (0.5 / 0.3 / 0.2, the large one first). Then for each
dataset: the time to open it (index read, layout checked, vocab sampled), and the rows of
consecutive train steps, --rows rows a step (a node's share of the global batch: 2048 / 32
nodes = 64), built for --seconds: sequences/s, on one process (the trainer builds the next
batch on its host thread while the device runs the step), --repeat passes over both. The
corpora were just written, so they are read mostly from the page cache (the first pass over
the first dataset partly from disk); a cold read from network storage is slower.

The requirement printed beside: the 3B config (configs/fuji-3b-trn2.toml: 2048 sequences of
8192 per step on 32 nodes) at the dry-run's predicted step time (--step-s, 5.96 s:
docs/dry-run.md) consumes 64 / 5.96 = 10.7 sequences/s per node.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trn_accum.data.datasets import make_dataset  # noqa: E402

VOCAB = 32_000


def write_megatron(prefix: str, n_tokens: int, seed: int) -> None:
    """A uint16 PREFIX.bin/.idx pair of about `n_tokens`, one sequence per document."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 20_000, n_tokens // 10_000 + 1).astype(np.int32)
    lengths = lengths[np.cumsum(lengths) <= n_tokens] if lengths.sum() > n_tokens else lengths
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, int(lengths.sum()), 1 << 26):
            n = min(1 << 26, int(lengths.sum()) - start)
            f.write(rng.integers(0, VOCAB, n, dtype=np.uint16).tobytes())
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1] * 2])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, lengths.size, lengths.size + 1))
        f.write(lengths.tobytes() + pointers.tobytes())
        f.write(np.arange(lengths.size + 1, dtype=np.int64).tobytes())


def measure(build, rows: int, seconds: float) -> tuple[float, float, int]:
    """(open seconds, sequences/s, steps) of `build()`'s rows over consecutive steps."""
    t0 = time.perf_counter()
    ds = build()
    opened = time.perf_counter() - t0
    ids = np.arange(rows)
    ds.rows(0, ids)  # first touch of the index arrays
    t0, step = time.perf_counter(), 1
    while time.perf_counter() - t0 < seconds:
        ds.rows(step, ids)
        step += 1
    dt = time.perf_counter() - t0
    return opened, (step - 1) * rows / dt, step - 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the main corpus, GB")
    ap.add_argument("--dir", default=None, help="where to write (default: a new dir in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=64, help="rows a step (a node's share)")
    ap.add_argument("--seconds", type=float, default=10.0, help="time each dataset this long")
    ap.add_argument("--step-s", type=float, default=5.96, help="predicted 3B step time, s")
    ap.add_argument("--repeat", type=int, default=2, help="passes over both datasets")
    args = ap.parse_args(argv)

    root = args.dir or tempfile.mkdtemp(prefix="data_throughput-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    try:
        t0 = time.perf_counter()
        n = int(args.gb * 1e9 / 2)
        paths = [os.path.join(root, name) for name in ("web", "code", "math")]
        for i, (p, size) in enumerate(zip(paths, (n, n // 4, n // 4), strict=True)):
            write_megatron(p, size, seed=i)
        written = sum(os.path.getsize(p + ".bin") for p in paths) / 1e9
        print(f"wrote {written:.2f} GB of Megatron corpora in {time.perf_counter() - t0:.1f} s")
        common = dict(seq_len=args.seq, batch_size=2048, vocab_size=VOCAB, seed=0)
        mix = [
            {"path": p, "kind": "megatron", "weight": w}
            for p, w in zip(paths, (0.5, 0.3, 0.2), strict=True)
        ]
        need = args.rows / args.step_s
        print(
            f"need: {need:.1f} sequences/s per node ({args.rows} rows of the 3B step every "
            f"{args.step_s} s); load average {os.getloadavg()[0]:.2f}"
        )
        cases = (
            (f"megatron {args.gb:g} GB", lambda: make_dataset("megatron", path=paths[0], **common)),
            ("mixture 0.5/0.3/0.2", lambda: make_dataset("mixture", mixture=mix, **common)),
        )
        for (name, build), rep in ((c, r) for r in range(args.repeat) for c in cases):
            opened, rate, steps = measure(build, args.rows, args.seconds)
            print(
                f"pass {rep + 1} {name}: open {opened:.2f} s, {rate:,.0f} sequences/s at seq "
                f"{args.seq} ({steps} steps of {args.rows} rows), {rate / need:,.0f}x the need; "
                f"load average {os.getloadavg()[0]:.2f}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
