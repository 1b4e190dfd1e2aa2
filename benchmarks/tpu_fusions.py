"""A calibration row's step as the TPU compiler fuses it, on a host without a chip: the bytes of
its kernels by kind, and the step priced from them (issue 46, part 2).

    PYTHONPATH=<libtpu> python benchmarks/tpu_fusions.py NAME [NAME ...] [--hlo-dir DIR]

NAME: a one-device tpu-v5e row of benchmarks/calibration.json. Needs the `libtpu` package
(`trn_accum.analysis.target_memory.tpu_devices`: deviceless compilation for a v5e slice of one
chip); 2-5 minutes a row on 2 cores. Per row: each top-level op of the compiled module (fusion
bodies are their fusion's) counted as many times as it runs, its bytes = what it reads + what
it writes, summed by kind: "kOutput" (the fusions around a dot or convolution, and bare ones),
"kLoop" and the other fusion kinds, copies, and the asynchronous copies and slices
(`*-start`/`*-done`, which the chip overlaps with compute). A dynamic update, bare or the root
of a fusion, is done in place: it reads and writes its update, not the buffer it updates
(`pricing.kernel_bytes`' rule; counted whole, the 100 MB f32 gradient buffers of the blockwise
backward at seq 8192 made 14.5 GB each a step of the proxy). Each byte is also placed by
memory space: the core's vector memory (layout `S(1)`, the 128 MiB VMEM,
`platforms.TPU_V5E_VMEM_BYTES`) or HBM. Then

    step = dots at the efficiency the chip measured for their shape (the row's
           `dot_shaped_flops` / peak) + the bytes of every kernel but the dot fusions and the
           asynchronous moves at the measured bandwidth (platforms.TPU_V5E_RATES)

which assumes each dot fusion is bound by its FLOPs and the rest by bytes: the roofline of
`trn_accum.analysis.roofline` over the compiler's own kernels, where the rule it applies to the
unfused module does not know which values the compiler keeps on chip. VMEM bytes are priced
as HBM bytes (their own bandwidth is not measured); the line also prints the step with them
free, the bound on what VMEM placement can save. `--hlo-dir DIR` writes each row's compiled module
to DIR/NAME.hlo (where its layouts show what sits in S(1)).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def compiled_text(row: dict) -> str:
    """The row's step compiled by the TPU compiler without a chip, as HLO text."""
    from trn_accum.analysis import target_memory
    from trn_accum.config.load import load_config
    from trn_accum.train import step as step_lib

    sys.path.insert(0, str(ROOT))
    from benchmarks.calibrate import dry_run_args

    path, sets = dry_run_args(row)
    cfg = load_config(str(ROOT / path), sets)
    devices = target_memory.tpu_devices("tpu-v5e", 1)
    if devices is None:
        raise SystemExit("no TPU compiler here: install libtpu (pip install -e '.[tpu]')")
    mesh = step_lib.make_mesh(cfg, devices)
    program = step_lib.build_step(cfg, mesh, batch_rows=cfg.data.global_batch)
    return program.lowered.compile().as_text()


def space_bytes(type_text: str) -> tuple[int, int]:
    """(HBM, VMEM) bytes of the arrays of an HLO type with layouts: an array whose layout
    names memory space 1 (`{...S(1)}`) is in the core's vector memory."""
    from trn_accum.analysis.hlo.text import parse_type

    hbm = vmem = 0
    for m in _LAID_OUT.finditer(re.sub(r"/\*.*?\*/", "", type_text)):
        (array,) = parse_type(f"{m.group(1)}[{m.group(2)}]")
        if "S(1)" in (m.group(3) or ""):
            vmem += array.nbytes
        else:
            hbm += array.nbytes
    return hbm, vmem


_LAID_OUT = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def in_place_update(module, ins):
    """The dynamic-update-slice `ins` is or whose fusion it roots, else None."""
    from trn_accum.analysis.hlo.text import names_in

    if ins.opcode == "dynamic-update-slice":
        return ins
    if ins.opcode != "fusion":
        return None
    called = names_in(ins.attrs.get("calls", ""), bare_ok=True)
    comp = module.computations.get(called[0]) if called else None
    root = comp.root if comp is not None else None
    return root if root is not None and root.opcode == "dynamic-update-slice" else None


def moved_bytes(module, ins) -> tuple[int, int]:
    """(HBM, VMEM) bytes one run of a top-level op reads + writes: its operands and result; an
    in-place dynamic update (`in_place_update`) instead skips the operand it updates (the one
    of the result's type) and writes its update's bytes where its result lies."""
    operands = [o.type_text for o in module.operand_instructions(ins)]
    hbm, vmem = space_bytes(ins.type_text)
    dus = in_place_update(module, ins)
    if dus is not None:
        if ins.type_text in operands:
            operands.remove(ins.type_text)
        update = sum(space_bytes(module.operand_instructions(dus)[1].type_text))
        hbm, vmem = (0, update) if vmem else (update, 0)
    for t in operands:
        h, v = space_bytes(t)
        hbm, vmem = hbm + h, vmem + v
    return hbm, vmem


def bytes_by_kind(module) -> dict[str, float]:
    """{kind: bytes read + written per step} of the module's top-level ops (see above), and
    {"<kind> vmem": the part of them in the core's vector memory}."""
    from trn_accum.analysis import pricing

    inner = pricing.applied_computations(module)
    out: dict[str, float] = collections.Counter()
    for ins in module.instructions():
        op = ins.opcode
        if ins.computation in inner or op in pricing.FREE_OPS:
            continue
        mult = module.trip_multiplier(ins.computation) or 1
        hbm, vmem = moved_bytes(module, ins)
        kind = ins.attrs.get("kind", op) if op == "fusion" else op
        if op in ("convolution", "dot"):
            kind = "kOutput"
        if op.endswith(("-start", "-done")):
            kind = "async"
        out[kind] += mult * (hbm + vmem)
        if vmem:
            out[f"{kind} vmem"] += mult * vmem
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    from trn_accum.analysis import platforms
    from trn_accum.analysis.hlo.module import parse_hlo

    sys.path.insert(0, str(ROOT))
    from benchmarks.calibrate import error_pct

    p = argparse.ArgumentParser(prog="python benchmarks/tpu_fusions.py")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--hlo-dir", default=None, help="write each compiled module here")
    a = p.parse_args(argv)
    rows = {
        r["name"]: r for r in json.loads((ROOT / "benchmarks/calibration.json").read_text())["rows"]
    }
    plat = platforms.TPU_V5E
    bw = plat.hbm_bytes_s * plat.efficiency.rates.bandwidth
    for name in a.names:
        row = rows[name]
        text = compiled_text(row)
        if a.hlo_dir:
            pathlib.Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(a.hlo_dir) / f"{name}.hlo").write_text(text)
        kinds = bytes_by_kind(parse_hlo(text))
        dots = row["features"]["dot_shaped_flops"] / plat.peak_flops
        priced = [k for k in kinds if k.split()[0] not in ("kOutput", "async")]
        rest = sum(kinds[k] for k in priced if not k.endswith(" vmem"))
        vmem = sum(kinds[k] for k in priced if k.endswith(" vmem"))
        step, no_vmem = dots + rest / bw, dots + (rest - vmem) / bw
        err, err_free = (error_pct(t, row["measured_s"]) for t in (step, no_vmem))
        by = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1]))
        print(
            f"{name}: measured {row['measured_s']:.4f} s; dots {dots:.4f} s + {rest / 1e9:.1f} GB "
            f"at the bandwidth {rest / bw:.4f} s = {step:.4f} s ({err:+.1f} %); with its "
            f"{vmem / 1e9:.1f} GB in VMEM free {no_vmem:.4f} s ({err_free:+.1f} %); "
            f"GB by kind: {by}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
