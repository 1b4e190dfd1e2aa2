"""Collectives of the compiled train step on the module Neuron would receive.

    .venv/bin/python benchmarks/program_collectives.py --config configs/fuji-3b-trn2.toml \
        --devices 64 --set model.num_layers=2 [--json]

Builds the step as the trainer and the dry-run do (`trn_accum.train.step.build_step`, the rows
of one node: global_batch / mesh.nodes), compiles it once and reads the module right after
XLA's SPMD partitioner (`trn_accum.analysis.hlo.partitioned`), before XLA:CPU's own passes. Prints
every distinct collective (kind, mesh axes, dtype, result shape, whether it runs in a loop) with
its count and bytes, and the three figures of issue 35's program faults. Counts are per program
text: the partitioned module carries no loop trip counts, so a collective in the minibatch loop
is counted once (it runs k times a step) and one in the loss's chunk loop once:

- reduce-scatters;
- all-reduces spanning "fsdp" at the full size of a gradient of an fsdp-sharded weight (at
  least the smallest such per-layer weight, gathered along "fsdp");
- all-gathers of the embedding table ([V/model, D] whole along D) and of a [rows, S, D]
  activation or cotangent along a batch axis.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys


def _set_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def smallest_gathered_weight(cfg, mesh_shape) -> int:
    """Elements of the smallest per-layer fsdp-sharded weight, whole along "fsdp" (its
    gradient's size before a reduce-scatter), split over "model" as the rules say."""
    import jax
    from jax.sharding import PartitionSpec as P

    from trn_accum.core.specs import spec_axes
    from trn_accum.model import fuji

    specs = jax.tree.leaves(
        fuji.param_specs(cfg.model, cfg.mesh.rules, mesh_shape), is_leaf=lambda s: isinstance(s, P)
    )
    sizes = []
    for spec, s in zip(specs, jax.tree.leaves(fuji.param_shapes(cfg.model)), strict=True):
        axes = [spec_axes(e) for e in spec] + [()] * (len(s.shape) - len(spec))
        if not any("fsdp" in a for a in axes):
            continue
        dims = [
            n // math.prod(mesh_shape[a] for a in ax if a != "fsdp")
            for n, ax in zip(s.shape, axes, strict=True)
        ]
        sizes.append(math.prod(dims[1:] if len(dims) > 2 else dims))  # a layer of [L, ...]
    return min(sizes)


def summarize(cfg, mesh_shape, text: str, rows_per_device: int) -> dict:
    from trn_accum.analysis.collectives import collectives, group_axes

    full = smallest_gathered_weight(cfg, mesh_shape)
    m = cfg.model
    vocab_local = m.vocab_size // mesh_shape.get("model", 1)
    table = {(vocab_local, m.hidden_dim), (m.hidden_dim, vocab_local)}
    rows = collections.Counter()
    nbytes = collections.Counter()
    faults = collections.Counter()
    fault_bytes = collections.Counter()
    for c in collectives(text):
        axes = group_axes(c.replica_groups, mesh_shape) if c.replica_groups else None
        trips = c.trip_multiplier or 1
        shapes = tuple(tuple(a.dims) for a in c.instruction.shapes)
        dtypes = ",".join(sorted(c.instruction.dtypes))
        key = (c.kind, axes, dtypes, shapes, c.in_loop)
        rows[key] += trips
        nbytes[key] += c.bytes * trips

        def fault(name, c=c, trips=trips):
            faults[name] += trips
            fault_bytes[name] += c.bytes * trips

        if c.kind == "reduce-scatter":
            fault("reduce_scatter")
        spans_fsdp = axes is None or "fsdp" in axes
        if c.kind == "all-reduce" and spans_fsdp:
            if any(math.prod(s) >= full for s in shapes):
                fault("all_reduce_full_size_fsdp_gradient")
        if c.kind == "all-gather":
            if any(s in table for s in shapes):
                fault(f"embedding_gather_{dtypes}")
            batchy = axes is None or {"data", "fsdp"} & set(axes)
            seq = cfg.data.seq_len
            if batchy and any(len(s) == 3 and s[1:] == (seq, m.hidden_dim) for s in shapes):
                fault(f"activation_gather_{dtypes}")
    return {
        "layers": m.num_layers,
        "smallest_gathered_weight_elements": full,
        "count": {k: faults[k] for k in sorted(faults)},
        "bytes": {k: fault_bytes[k] for k in sorted(fault_bytes)},
        "collectives": [
            {
                "kind": k[0],
                "axes": k[1],
                "dtype": k[2],
                "shapes": k[3],
                "in_loop": k[4],
                "count": n,
                "bytes": nbytes[k],
            }
            for k, n in sorted(rows.items(), key=lambda kv: (kv[0][0], -nbytes[kv[0]]))
        ],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/fuji-3b-trn2.toml")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _set_devices(args.devices)

    import time

    from trn_accum.analysis.hlo.partitioned import compile_partitioned
    from trn_accum.config.load import load_config
    from trn_accum.train import step

    cfg = load_config(args.config, args.overrides)
    mesh = step.make_mesh(cfg)
    rows = cfg.data.global_batch // cfg.mesh.nodes
    program = step.build_step(cfg, mesh, batch_rows=rows)
    t0 = time.perf_counter()
    _, text = compile_partitioned(program.lowered)
    secs = time.perf_counter() - t0
    shards = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    out = summarize(cfg, dict(mesh.shape), text, rows // shards)
    out.update(
        mesh=dict(mesh.shape),
        rows_per_node=rows,
        accum_steps=cfg.trainer.accum_steps,
        reduce=cfg.trainer.reduce,
        compile_s=round(secs, 1),
    )
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=str)
        print()
        return 0
    print(
        f"mesh {out['mesh']}, {out['layers']} layers, k={out['accum_steps']}, "
        f"reduce={out['reduce']}, compile {out['compile_s']} s"
    )
    for name, n in out["count"].items():
        print(f"  {name:45s} {n:6d} count {out['bytes'][name] / 2**20:12.1f} MiB")
    print("kind            axes                 dtype        count        MiB  loop  shapes")
    for r in out["collectives"]:
        print(
            f"{r['kind']:15s} {str(r['axes']):20s} {r['dtype']:9s} {r['count']:8d} "
            f"{r['bytes'] / 2**20:10.2f}  {'yes' if r['in_loop'] else 'no ':3s}  "
            f"{r['shapes']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
