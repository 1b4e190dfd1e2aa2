"""Accumulation benchmark: prints a markdown table.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/accumulation.py

On 8 emulated CPU devices, mesh (data=2, fsdp=4), parameters sharded over fsdp, a fixed global
batch, and an MLP whose activations dominate memory (token-level softmax regression with a
padding mask, activations constrained to the batch sharding):

- collectives of the split: strided (ours) vs contiguous;
- collectives of the whole accumulated step (k=4, scan) vs the full-batch step;
- per-device temp memory (`memory_analysis`) for k = 1, 2, 4, 8, loop="scan" and "unroll";
- step time k=4 vs k=1 (median of >= 5 runs after warm-up);
- compile time k=16 vs k=2 (loop="scan");
- max relative gradient error against the full batch under uneven padding: exact weighting
  (ours) vs the mean of minibatch means.

XLA:CPU figures are a proxy for trn2 (see docs/design.md), not a fit check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trn_accum import Strategy, accumulate_gradients
from trn_accum.analysis import collectives as coll
from trn_accum.core.constraints import constrain
from trn_accum.core.mesh import build_mesh
from trn_accum.core.specs import leaf_specs
from trn_accum.core.split import split_minibatches

BATCH_AXES = ("data", "fsdp")
SPEC = P(BATCH_AXES)
KINDS = coll.MAIN_COLLECTIVES


def make_problem(mesh, *, batch, seq, dim, hidden, classes, layers, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w_in": rng.standard_normal((dim, hidden)) / np.sqrt(dim)}
    for i in range(layers):
        params[f"w{i}"] = rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)
    params["w_out"] = rng.standard_normal((hidden, classes)) / np.sqrt(hidden)
    params = {k: v.astype(np.float32) for k, v in params.items()}
    pspecs = {k: P("fsdp", None) for k in params}
    # Uneven padding: row r keeps a fraction of its tokens growing with r (no row empty).
    keep = np.linspace(0.1, 1.0, batch)[:, None]
    mask = (rng.uniform(size=(batch, seq)) < keep).astype(np.float32)
    mask[:, 0] = 1.0
    data = {
        "x": rng.standard_normal((batch, seq, dim)).astype(np.float32),
        "y": rng.integers(0, classes, (batch, seq)).astype(np.int32),
        "mask": mask,
    }

    def act(h):  # activations sharded like the batch (manual axes dropped under reduce="once")
        return constrain(h, mesh, P(BATCH_AXES))

    def loss_fn(params, batch):
        h = act(jnp.tanh(batch["x"] @ params["w_in"]))
        for i in range(layers):
            h = act(jnp.tanh(h @ params[f"w{i}"]) + h)
        logits = act(h @ params["w_out"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1)[..., 0]
        return (nll * batch["mask"]).sum() / batch["mask"].sum()

    params = {k: jax.device_put(v, NamedSharding(mesh, pspecs[k])) for k, v in params.items()}
    specs = leaf_specs(data, SPEC)
    leaves, treedef = jax.tree.flatten(data)
    data = jax.tree.unflatten(
        treedef,
        [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)],
    )
    return loss_fn, params, pspecs, data


def weight_fn(mb):
    return mb["mask"].sum()


def contiguous_split(batch, k, mesh):
    def one(x):
        y = x.reshape(k, x.shape[0] // k, *x.shape[1:])
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, BATCH_AXES)))

    return jax.tree.map(one, batch)


def fmt_counts(counts: dict) -> str:
    parts = [f"{k} {v}" for k, v in counts.items() if v]
    return ", ".join(parts) if parts else "none"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def timed_compile(fn, *args):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def median_runtime(compiled, args, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(a, b) -> float:
    errs = [
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--classes", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    if jax.device_count() != 8:
        print(
            f"need 8 devices, got {jax.device_count()}: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8",
            file=sys.stderr,
        )
        return 2

    mesh = build_mesh({"data": 2, "fsdp": 4})
    loss_fn, params, pspecs, data = make_problem(
        mesh,
        batch=args.batch,
        seq=args.seq,
        dim=args.dim,
        hidden=args.hidden,
        classes=args.classes,
        layers=args.layers,
    )
    n_params = sum(int(np.prod(p.shape)) for p in params.values())
    rows = []

    def acc_fn(k, loop="scan", weighted=True, reduce="per_minibatch"):
        return accumulate_gradients(
            loss_fn,
            steps=k,
            mesh=mesh,
            batch_spec=SPEC,
            param_specs=pspecs,
            weight_fn=weight_fn if weighted else None,
            strategy=Strategy(loop=loop, reduce=reduce),
        )

    # 1. The split alone, with both partitioners.
    shardy = jax.config.jax_use_shardy_partitioner
    for partitioner in ("shardy", "gspmd"):
        jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
        for name, fn in (
            ("strided (ours)", lambda b: split_minibatches(b, 4, mesh=mesh, batch_spec=SPEC)),
            ("contiguous", lambda b: contiguous_split(b, 4, mesh)),
        ):
            c = jax.jit(fn).lower(data).compile()
            counts = coll.count_collectives(c.as_text())["total"]
            rows.append((f"split k=4, {name}, {partitioner}: collectives", fmt_counts(counts)))
    jax.config.update("jax_use_shardy_partitioner", shardy)

    # 2. The whole step: accumulated (scan, k=4) vs the full batch.
    full_c, _ = timed_compile(jax.value_and_grad(loss_fn), params, data)
    acc4_c, _ = timed_compile(acc_fn(4), params, data)
    full_counts = coll.count_collectives(full_c.as_text())
    acc_counts = coll.count_collectives(acc4_c.as_text())
    rows.append(("full-batch step: collectives", fmt_counts(full_counts["total"])))
    rows.append(
        (
            "accumulated step k=4 (scan): collectives outside / inside the loop",
            f"{fmt_counts(acc_counts['outside_loops'])} / {fmt_counts(acc_counts['inside_loops'])}",
        )
    )

    # 2b. Gradient reductions over the data axis: per minibatch vs once (issue 6).
    once4_c, _ = timed_compile(acc_fn(4, reduce="once"), params, data)
    for name, c in (("per_minibatch", acc4_c), ("once", once4_c)):
        ars = [
            x
            for x in coll.collectives(c.as_text())
            if x.kind == "all-reduce"
            and "data" in (coll.group_axes(x.replica_groups, mesh.shape) or ())
        ]
        inside = sum(x.in_loop for x in ars)
        per_step = sum(x.bytes * (x.trip_multiplier or 1) for x in ars)
        rows.append(
            (
                f"k=4, reduce={name}: all-reduces over data inside / outside the loop, "
                "bytes per step",
                f"{inside} / {len(ars) - inside}, {per_step:,} B",
            )
        )

    # 3. Memory vs k.
    temps = {}
    for loop in ("scan", "unroll"):
        for k in (1, 2, 4, 8):
            c = jax.jit(acc_fn(k, loop)).lower(params, data).compile()
            temps[loop, k] = c.memory_analysis().temp_size_in_bytes
        base = temps[loop, 1]
        rows.append(
            (
                f"temp memory per device, loop={loop}, k=1/2/4/8",
                " / ".join(
                    f"{mib(temps[loop, k])} ({temps[loop, k] / base:.2f}x)" for k in (1, 2, 4, 8)
                ),
            )
        )

    # 4. Step time k=4 vs k=1.
    acc1_c, _ = timed_compile(acc_fn(1), params, data)
    t1 = median_runtime(acc1_c, (params, data), args.runs)
    t4 = median_runtime(acc4_c, (params, data), args.runs)
    t4o = median_runtime(once4_c, (params, data), args.runs)
    rows.append(
        (
            f"step time (median of {args.runs}), k=1 / k=4 (scan) / k=4 reduce=once",
            f"{t1 * 1e3:.1f} ms / {t4 * 1e3:.1f} ms (ratio {t4 / t1:.2f}) / "
            f"{t4o * 1e3:.1f} ms (ratio {t4o / t1:.2f})",
        )
    )

    # 5. Compile time k=16 vs k=2 (best of 2 each: the machine may be shared).
    ct = {}
    for k in (2, 16):
        ct[k] = min(timed_compile(acc_fn(k), params, data)[1] for _ in range(2))
    rows.append(
        (
            "compile time (scan), k=2 / k=16",
            f"{ct[2]:.2f} s / {ct[16]:.2f} s (ratio {ct[16] / ct[2]:.2f})",
        )
    )

    # 6. Exactness under uneven padding.
    ref = jax.jit(jax.grad(loss_fn))(params, data)
    for k in (4, 8):
        _, ours = jax.jit(acc_fn(k))(params, data)
        _, mom = jax.jit(acc_fn(k, weighted=False))(params, data)
        rows.append(
            (
                f"max relative grad error vs full batch, k={k}: ours / mean of means",
                f"{rel_err(ours, ref):.1e} / {rel_err(mom, ref):.1e}",
            )
        )

    print(
        f"# trn_accum accumulation benchmark: {jax.device_count()} {jax.devices()[0].platform} "
        f"devices, mesh (data=2, fsdp=4), jax {jax.__version__}, "
        f"partitioner {'shardy' if jax.config.jax_use_shardy_partitioner else 'gspmd'}"
    )
    print(
        f"# MLP: batch {args.batch} x seq {args.seq}, dim {args.dim}, hidden {args.hidden}, "
        f"{args.layers} layers, {args.classes} classes, {n_params:,} parameters (fsdp-sharded); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print()
    print("| measurement | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
