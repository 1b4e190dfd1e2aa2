"""A calibration row's step as the TPU compiler fuses it, on a host without a chip: the bytes of
its kernels by kind, and the step priced from them (issue 46, part 2).

    PYTHONPATH=<libtpu> python benchmarks/tpu_fusions.py NAME [NAME ...]

NAME: a one-device tpu-v5e row of benchmarks/calibration.json. Needs the `libtpu` package
(`trn_accum.analysis.target_memory.tpu_devices`: deviceless compilation for a v5e slice of one
chip); 2-5 minutes a row on 2 cores. Per row: each top-level op of the compiled module (fusion
bodies are their fusion's) counted as many times as it runs, its bytes = what it reads + what
it writes, summed by kind: "kOutput" (the fusions around a dot or convolution, and bare ones),
"kLoop" and the other fusion kinds, copies, and the asynchronous copies and slices
(`*-start`/`*-done`, which the chip overlaps with compute). Then

    step = dots at the efficiency the chip measured for their shape (the row's
           `dot_shaped_flops` / peak) + the bytes of every kernel but the dot fusions and the
           asynchronous moves at the measured bandwidth (platforms.TPU_V5E_RATES)

which assumes each dot fusion is bound by its FLOPs and the rest by bytes: the roofline of
`trn_accum.analysis.roofline` over the compiler's own kernels, where the rule it applies to the
unfused module does not know which values the compiler keeps on chip.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def compiled_module(row: dict):
    """The row's step compiled by the TPU compiler without a chip, parsed."""
    from trn_accum.analysis import target_memory
    from trn_accum.analysis.hlo import parse_hlo
    from trn_accum.train import step as step_lib
    from trn_accum.train.config import load_config

    sys.path.insert(0, str(ROOT))
    from benchmarks.calibrate import dry_run_args

    path, sets = dry_run_args(row)
    cfg = load_config(str(ROOT / path), sets)
    devices = target_memory.tpu_devices("tpu-v5e", 1)
    if devices is None:
        raise SystemExit("no TPU compiler here: install libtpu (pip install -e '.[tpu]')")
    mesh = step_lib.make_mesh(cfg, devices)
    program = step_lib.build_step(cfg, mesh, batch_rows=cfg.data.global_batch)
    return parse_hlo(program.lowered.compile().as_text())


def bytes_by_kind(module) -> dict[str, float]:
    """{kind: bytes read + written per step} of the module's top-level ops (see above)."""
    from trn_accum.analysis import pricing

    inner = pricing.applied_computations(module)
    out: dict[str, float] = collections.Counter()
    for ins in module.instructions():
        op = ins.opcode
        if ins.computation in inner or op in pricing.FREE_OPS:
            continue
        mult = module.trip_multiplier(ins.computation) or 1
        moved = sum(o.result_bytes for o in module.operand_instructions(ins)) + ins.result_bytes
        kind = ins.attrs.get("kind", op) if op == "fusion" else op
        if op in ("convolution", "dot"):
            kind = "kOutput"
        if op.endswith(("-start", "-done")):
            kind = "async"
        out[kind] += mult * moved
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    from trn_accum.analysis import platforms

    names = sys.argv[1:] if argv is None else argv
    rows = {
        r["name"]: r for r in json.loads((ROOT / "benchmarks/calibration.json").read_text())["rows"]
    }
    plat = platforms.TPU_V5E
    bw = plat.hbm_bytes_s * plat.efficiency.rates.bandwidth
    for name in names:
        row = rows[name]
        kinds = bytes_by_kind(compiled_module(row))
        dots = row["features"]["dot_shaped_flops"] / plat.peak_flops
        rest = sum(v for k, v in kinds.items() if k not in ("kOutput", "async"))
        step = dots + rest / bw
        err = 100 * (step - row["measured_s"]) / row["measured_s"]
        by = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1]))
        print(
            f"{name}: measured {row['measured_s']:.4f} s; dots {dots:.4f} s + {rest / 1e9:.1f} GB "
            f"at the bandwidth {rest / bw:.4f} s = {step:.4f} s ({err:+.1f} %); GB by kind: {by}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
