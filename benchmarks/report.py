"""One benchmark report of the real train step: JSON plus the markdown of docs/benchmarks.md.

    make bench        # = XLA_FLAGS=--xla_force_host_platform_device_count=8 \
                      #   .venv/bin/python benchmarks/report.py

On 8 emulated CPU devices, for the tiny Fuji config (configs/fuji-tiny.toml)
and a mid-sized one (the same file with 12 layers x 256 hidden, see MID below), using the
trainer's own pieces (`trn_accum.train.make_train_step`: accumulation, clipping, AdamW, the
non-finite guard, donated state, explicit shardings), at a fixed global batch:

- collectives of the minibatch split alone, strided (ours) vs contiguous;
- per k and per `trainer.reduce` ("per_minibatch", "once"): all-reduces over the data groups
  inside and outside the accumulation loop and the bytes they move per optimizer step (result
  bytes x loop trip counts, from the compiled HLO's shapes and replica groups);
- per-device temporary memory (`memory_analysis`), compile time (lower + compile), step time
  (median of >= 5 runs after a warm-up run; ratio to k=1) and tokens/s;
- the peers table (benchmarks/peers.py): full batch, ours (both reduce modes), a contiguous
  in-graph scan and optax.MultiSteps on one model, batch and mesh, timed round-robin.

Writes `--out` (default benchmarks/out/, ignored by git): report.json and benchmarks.md (the
section `benchmarks/report_md.py` renders), and prints the markdown; the checkout stays as it
was. `--publish` also replaces the committed benchmarks/report.json and the text between
`<!-- bench:start -->` and `<!-- bench:end -->` in docs/benchmarks.md (what a maintainer runs
to update the published figures; tests/test_docs.py checks that the two agree).

XLA:CPU figures are a proxy: temporaries are not a trn2 fit check (docs/design.md), the CPU
"collectives" are memory copies between threads, and on a shared 2-core machine times move by
tens of percent between runs (the load average is recorded).

XLA:CPU deadlock workaround: the script adds
`--xla_cpu_enable_concurrency_optimized_scheduler=false` to XLA_FLAGS before JAX starts (unless
XLA_FLAGS already sets it). With the default scheduler, the tiny config's step at k=2 hangs
within 30 steps (3 runs of 3 here, jax 0.10.2): devices issue an fsdp all-gather and an
all-reduce over all devices in different orders and XLA:CPU's in-process rendezvous aborts
after 40 s. With the flag: 40 steps, no hang.

Why 12 x 256 and not 12 x 768: at 12 x 768 (78.7M parameters) one step of 1024 tokens took
15-21 s at k=1 and 51-72 s at k=8 here (per-minibatch work on the parameters: gathers, gradient
reductions, accumulation), so >= 5 timed runs per k would take over 10 minutes. Pass
`--mid-hidden 768 --mid-heads 12` to measure it anyway.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

_NO_DEADLOCK = "--xla_cpu_enable_concurrency_optimized_scheduler"
if _NO_DEADLOCK not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_NO_DEADLOCK}=false".strip()

import jax  # noqa: E402
import report_md  # noqa: E402  (benchmarks/report_md.py, beside this script)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trn_accum.analysis import collectives as coll  # noqa: E402
from trn_accum.analysis.hlo import module as hlo  # noqa: E402
from trn_accum.config.load import load_config  # noqa: E402
from trn_accum.core.split import split_minibatches  # noqa: E402
from trn_accum.model import fuji  # noqa: E402
from trn_accum.train import loop, step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = "configs/fuji-tiny.toml"
REDUCES = ("per_minibatch", "once")


def mid_overrides(args) -> list[str]:
    heads = args.mid_heads
    return [
        f"model.num_layers={args.mid_layers}",
        f"model.hidden_dim={args.mid_hidden}",
        f"model.num_heads={heads}",
        f"model.num_kv_heads={max(1, heads // 2)}",
        f"model.head_dim={args.mid_hidden // heads}",
        f"model.ffn_dim={3 * args.mid_hidden}",
        "model.vocab_size=4096",
        f"model.max_seq_len={args.mid_seq}",
        "model.compute_dtype=float32",  # XLA:CPU runs bf16 dots in float32 anyway, slower
        f"data.seq_len={args.mid_seq}",
        f"data.global_batch={args.mid_batch}",
    ]


# ---------------------------------------------------------------------------------------------
# Measurements


def contiguous_split(batch, k, mesh):
    """Minibatch i = rows [i·B/k, (i+1)·B/k), stated in the stacked sharding (for contrast)."""

    def one(x):
        y = x.reshape(k, x.shape[0] // k, *x.shape[1:])
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, step.BATCH_AXES)))

    return jax.tree.map(one, batch)


def split_collectives(mesh, batch_abstract, k) -> dict[str, dict[str, int]]:
    out = {}
    for name, fn in (
        ("strided", lambda b: split_minibatches(b, k, mesh=mesh, batch_spec=step.BATCH_SPEC)),
        ("contiguous", lambda b: contiguous_split(b, k, mesh)),
    ):
        jitted = jax.jit(fn, in_shardings=(step.batch_sharding(mesh),))
        with jax.set_mesh(mesh):
            text = jitted.lower(batch_abstract).compile().as_text()
        counts = coll.count_collectives(text, coll.MAIN_COLLECTIVES)["total"]
        out[name] = {kind: n for kind, n in counts.items() if n}
    return out


def accumulation_loop_computations(module: hlo.HloModule, k: int) -> frozenset[str]:
    """Computations run by the accumulation loop: the body and condition (and everything they
    call) of the outermost `while` with trip count k. Layer scans are loops too: nested inside
    it when k > 1, on their own when k = 1 (no accumulation loop)."""
    if k == 1:
        return frozenset()
    roots = []
    for ins in module.while_loops():
        if not module.in_loop(ins) and ins.trip_count == k:
            roots += list(ins.called_computations)
    if not roots:
        raise RuntimeError(f"no top-level while loop with trip count {k} in the compiled step")
    return module.reachable_from(*roots)


def data_all_reduces(module: hlo.HloModule, mesh_shape, k: int) -> dict[str, int]:
    """All-reduces whose replica groups span "data": ops inside / outside the accumulation
    loop, and bytes per optimizer step (result bytes x the trip counts of enclosing loops)."""
    acc = accumulation_loop_computations(module, k)
    inside = outside = per_step = 0
    for c in coll.collectives(module):
        if c.kind != "all-reduce" or "data" not in (
            coll.group_axes(c.replica_groups, mesh_shape) or ()
        ):
            continue
        if c.computation in acc:
            inside += 1
        else:
            outside += 1
        per_step += c.bytes * (c.trip_multiplier or 1)
    return {"inside_loop": inside, "outside_loop": outside, "bytes_per_step": per_step}


def time_steps(compiled, state, batch, runs: int, warmup: int):
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return state, times, jax.device_get(metrics)


def bench_config(name, overrides, *, ks, reduces, runs, warmup, log):
    cfg1 = load_config(ROOT / TINY, [*overrides, "trainer.accum_steps=1"])
    trainer = loop.Trainer.build(cfg1)  # the mesh, optimizer, state shardings, data
    mesh = trainer.mesh
    shards = step.batch_shards(mesh)
    b, s = cfg1.data.global_batch, cfg1.data.seq_len
    ks = [k for k in ks if b % (k * shards) == 0]
    state, batch = trainer.init(), trainer.batch(0)
    tokens = b * s
    log(
        f"[{name}] {fuji.num_params(cfg1.model):,} parameters, mesh {dict(mesh.shape)}, batch "
        f"{b} x {s}, k in {ks}"
    )
    k_split = max(k for k in ks if k <= 4)
    split = split_collectives(mesh, step.abstract_batch(cfg1, mesh), k_split)
    rows = []
    for reduce in reduces:
        for k in ks:
            if reduce == "once" and k == 1:
                continue
            cfg = load_config(
                ROOT / TINY, [*overrides, f"trainer.accum_steps={k}", f"trainer.reduce={reduce}"]
            )
            t0 = time.perf_counter()
            compiled = step.build_step(cfg, mesh).compiled  # the trainer's own builder
            compile_s = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            module = hlo.parse_hlo(compiled.as_text())
            state, times, metrics = time_steps(compiled, state, batch, runs, warmup)
            med = statistics.median(times)
            row = {
                "k": k,
                "reduce": reduce,
                "temp_bytes": int(mem.temp_size_in_bytes),
                "argument_bytes": int(mem.argument_size_in_bytes),
                "compile_s": round(compile_s, 2),
                "step_s_median": med,
                "step_s_runs": [round(t, 4) for t in times],
                "tokens_per_s": tokens / med,
                "data_all_reduces": data_all_reduces(module, dict(mesh.shape), k),
                "collectives": {
                    w: {kind: n for kind, n in c.items() if n}
                    for w, c in coll.count_collectives(module).items()
                    if w in ("outside_loops", "inside_loops")
                },
                "loss": float(metrics["loss"]),
            }
            rows.append(row)
            log(
                f"  k={k} {reduce}: temp {row['temp_bytes'] / 2**20:.2f} MiB, compile "
                f"{compile_s:.1f} s, step {med * 1e3:.0f} ms, data all-reduces "
                f"{row['data_all_reduces']}"
            )
    base = {r["reduce"]: r for r in rows if r["k"] == 1}.get("per_minibatch")
    for r in rows:
        if base:
            r["step_ratio_to_k1"] = r["step_s_median"] / base["step_s_median"]
            r["temp_ratio_to_k1"] = r["temp_bytes"] / base["temp_bytes"]
    m = cfg1.model
    return {
        "name": name,
        "overrides": list(overrides),
        "model": f"{m.num_layers} layers x {m.hidden_dim} hidden, {m.num_heads} heads "
        f"({m.num_kv_heads} KV) x {m.head_dim}, FFN {m.ffn_dim}, vocab {m.vocab_size}, "
        f"{m.compute_dtype}, layers {m.layer_loop}, remat {m.remat}",
        "params": fuji.num_params(m),
        "mesh": dict(mesh.shape),
        "global_batch": b,
        "seq_len": s,
        "tokens_per_step": tokens,
        "split_k": k_split,
        "split_collectives": split,
        "runs": runs,
        "warmup": warmup,
        "rows": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs per step (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ks", default="1,2,4,8", help="accumulation steps (those that divide)")
    ap.add_argument("--mid-layers", type=int, default=12)
    ap.add_argument("--mid-hidden", type=int, default=256)
    ap.add_argument("--mid-heads", type=int, default=4)
    ap.add_argument("--mid-seq", type=int, default=64)
    ap.add_argument("--mid-batch", type=int, default=64)
    ap.add_argument("--only", choices=("tiny", "mid"), help="one config only")
    ap.add_argument("--no-peers", action="store_true", help="skip the peers table (peers.py)")
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "out"), help="report.json + benchmarks.md"
    )
    ap.add_argument(
        "--publish",
        action="store_true",
        help="also write the committed benchmarks/report.json and docs/benchmarks.md's section",
    )
    args = ap.parse_args(argv)
    if jax.device_count() != 8:
        print(
            f"need 8 devices, got {jax.device_count()}: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8",
            file=sys.stderr,
        )
        return 2
    if args.runs < 5:
        print(f"--runs {args.runs}: note, the report asks for a median of >= 5", file=sys.stderr)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    ks = [int(k) for k in args.ks.split(",")]
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]
    configs = []
    plan = [("tiny", [], ks), ("mid", mid_overrides(args), ks)]
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    for name, overrides, kk in plan:
        label = f"{name} ({TINY})" if name == "tiny" else f"mid ({TINY} + overrides)"
        configs.append(
            bench_config(
                label, overrides, ks=kk, reduces=REDUCES, runs=args.runs, warmup=args.warmup,
                log=log,
            )
        )  # fmt: skip
    report = {
        "meta": {
            "command": "make bench",
            "jax": jax.__version__,
            "devices": jax.device_count(),
            "platform": jax.devices()[0].platform,
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "total_s": time.perf_counter() - t_start,
            "argv": sys.argv[1:] if argv is None else list(argv),
        },
        "configs": configs,
    }
    if not args.no_peers:
        import peers  # benchmarks/peers.py, beside this script

        report["peers"] = peers.run(ROOT, log=log)
    text = report_md.section(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "benchmarks.md").write_text(text, encoding="utf-8")
    print(text)
    log(f"wrote {out / 'report.json'} and {out / 'benchmarks.md'}")
    if args.publish:
        page = ROOT / "docs" / "benchmarks.md"
        if not report_md.replace_section(page, text):
            log(f"{page} has no {report_md.START} ... {report_md.END} markers: not published")
            return 1
        (ROOT / "benchmarks" / "report.json").write_text(
            json.dumps(report, indent=2) + "\n", encoding="utf-8"
        )
        log(f"published: benchmarks/report.json and the bench section of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
