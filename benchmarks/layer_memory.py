"""Compiled memory per device of the train step at two layer counts, and its growth per layer.

    .venv/bin/python benchmarks/layer_memory.py --proxy --program per_device [--no-licm] [--json]
    .venv/bin/python benchmarks/layer_memory.py --config configs/fuji-3b-trn2.toml --devices 64

Builds the step as the trainer and the dry-run do (`trn_accum.train.step.build_step`, the rows
of one node), compiles it at each of `--layers` and reads XLA:CPU's `memory_analysis()`
(arguments + outputs - aliased + temporaries, `fit.compiled_total_bytes`'s sum). `--program`:
"per_device" (model/fsdp.py's loss, as shipped), "untied" (the same without
`gather_once.tie_backward`: each layer's weight gradients free to be scheduled late) or
"partitioner" (the loss left to XLA's SPMD partitioner). `--proxy`: fuji-tiny widened to a
Fuji-shaped model that compiles in seconds on 8 devices, fsdp 4 x model 2 (the 3B mesh's kind),
unrolled, k=2 (`PROXY` below). `--no-licm`: XLA's while-loop invariant code motion off; on the
proxy it hoists every layer's forward weight gathers out of the minibatch loop (in float32),
which it does not do on the 3B mesh (fsdp 32), so the proxy without it is the closer picture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROXY = [
    "mesh.data=1",
    "mesh.fsdp=4",
    "mesh.model=2",
    'mesh.rules="trn2"',
    'model.layer_loop="unroll"',
    "model.hidden_dim=512",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=128",
    "model.ffn_dim=1536",
    "model.vocab_size=8192",
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "data.global_batch=8",
    "model.loss_chunk=128",
    'model.attention="blockwise"',
    "model.attention_block=128",
    "trainer.accum_steps=2",
]


def _set_flags(devices: int, licm: bool) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags += f" --xla_force_host_platform_device_count={devices}"
    flags += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    if not licm:
        flags += " --xla_disable_hlo_passes=while-loop-invariant-code-motion"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def _choose(program: str) -> None:
    from trn_accum.core import gather_once
    from trn_accum.model import fsdp

    if program == "partitioner":
        fsdp.manual_axes = lambda: ()
    elif program == "untied":
        gather_once.tie_backward = lambda x, tree, *specs: (x, tree)


def compiled_bytes(config: str, overrides: list[str]) -> int:
    """`fit.compiled_total_bytes` of the step of `config` with `overrides`."""
    from trn_accum.analysis.memory import compiled_memory
    from trn_accum.config.load import load_config
    from trn_accum.train import step

    cfg = load_config(config, overrides)
    mesh = step.make_mesh(cfg)
    program = step.build_step(cfg, mesh, batch_rows=cfg.data.global_batch // cfg.mesh.nodes)
    m = compiled_memory(program.lowered.compile())
    return m["argument"] + m["output"] - m["alias"] + m["temp"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/fuji-tiny.toml")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    p.add_argument("--proxy", action="store_true")
    p.add_argument("--layers", type=int, nargs=2, default=(2, 4))
    p.add_argument(
        "--program", default="per_device", choices=("per_device", "untied", "partitioner")
    )
    p.add_argument("--no-licm", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _set_flags(args.devices, not args.no_licm)
    _choose(args.program)
    base = (PROXY if args.proxy else []) + args.overrides
    sizes = {n: compiled_bytes(args.config, base + [f"model.num_layers={n}"]) for n in args.layers}
    (a, ba), (b, bb) = sorted(sizes.items())
    out = {
        "program": args.program,
        "licm": not args.no_licm,
        "bytes": sizes,
        "per_layer_bytes": (bb - ba) / (b - a),
    }
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    per_layer = out["per_layer_bytes"] / 2**20
    mib = ", ".join(f"{n} layers {v / 2**20:.2f} MiB" for n, v in sizes.items())
    licm = "on" if out["licm"] else "off"
    print(f"{out['program']} (licm {licm}): {mib}; {per_layer:.2f} MiB per layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
