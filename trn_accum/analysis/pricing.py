"""Every op of a partitioned train step priced at what the hardware achieves, not at peak.

Input: the module right after XLA's SPMD partitioner (`trn_accum.analysis.hlo.partitioned`): shard
shapes, the dtypes the program wrote, no backend fusion. Each reachable instruction counts as
many times as it runs (`HloModule.trip_multiplier`, loops' trip counts included) in the
features (`op_features`), per device and step (the partitioner's sharding names,
`Instruction.names_sharding_only`, are no ops and count nowhere):

- `dot_flops`: 2 x M x N x K of every dot, each of M, N, K rounded up to the matrix unit's tile
  (`Efficiency.tile`: a 100 x 100 product costs a 128 x 128 one), the shape part of a dot's
  efficiency;
- `kernel_bytes`: HBM bytes of the ops that stay kernels of their own after fusion and move
  memory: reductions (operand bytes), gathers, scatters, dynamic slices and updates, sorts,
  transposes, copies, concatenations, pads and slices (bytes read + written). A copy whose
  result has its operand's type and layout moves nothing: the partitioner leaves one after
  most ops of a sharded program (1,789 in the 3B step at 2 layers, 171 copies left in XLA:CPU's
  final program, most of those from its own copy insertion), and XLA's algebraic simplifier,
  which every backend runs after partitioning, removes it ("All copies can be eliminated
  (assuming layout constraints are satisfied)", `AlgebraicSimplifierVisitor::HandleCopy`,
  xla/hlo/transforms/simplifiers/algebraic_simplifier.cc), so it is free here;
- `elementwise_bytes` / `loop_elementwise_bytes`: result bytes of elementwise ops (add,
  convert, exp, select, ...) outside / inside `while` loops; a backend fuses most of them, so
  their achieved rates (`Efficiency.elementwise`, `.loop_elementwise`) are fitted multiples of
  the HBM bandwidth that fold the fusion in (above 1: fewer bytes reach HBM than the unfused
  ops write). Apart because fusion differs: straight-line code (the optimizer update, a step
  without accumulation loop) fuses long chains, a loop body (the accumulation, blockwise
  attention, loss chunks) only within one iteration (the TPU v5e prices both at one rate:
  `trn_accum.analysis.platforms` says why);
- `kernels`: launches of ops that are kernels of their own (dots, reductions, gathers,
  scatters, dynamic slices, sorts, custom calls), each a fixed cost (`Efficiency.kernel_s`);
- `loop_iterations`: `while` iterations, each a fixed cost (`Efficiency.loop_iter_s`);
- `dot_shaped_flops`: with measured `Rates` (`trn_accum.analysis.rates`), each dot's padded
  FLOPs over the share of peak the chip reaches at its shape: the FLOPs a dot would do at peak
  in the time it takes;
- `unfused_kernel_bytes`: the bytes of the kernel ops that no backend fuses (gathers,
  scatters, dynamic updates, sorts, custom calls; not the slices, transposes and
  concatenations a fusion reads through, `trn_accum.analysis.hlo.fusion.FUSIBLE`), for
  pricing at the measured bandwidth;
- `offchip_elementwise_bytes`: of the elementwise result bytes above (in and out of loops),
  those of results at least as large as the core's on-chip memory (`Efficiency.onchip_bytes`;
  0 where a platform states none), which no compiler can keep on chip between kernels. A
  TPU's compiler places buffers that fit in the core's vector memory (VMEM, memory space
  S(1) in its HLO): in the TPU v5e's compiled step of the 4-layer proxy at seq 8192 (k 2,
  blockwise 1024) 48 of the 140 f32 [24, 1024, 1024] score blocks (96 MiB) are in S(1), and
  at k 1 none of the [2, 24, 1024, 1024] blocks (192 MiB) is; that step ran 24 % slower on
  the chip for the same counted work (`benchmarks/tpu_fusions.py` prints each row's bytes by memory
  space). Priced as an extra per byte (`Efficiency.offchip_elementwise`), fitted.

A platform with measured `Rates` (`Efficiency.rates`) prices its dots by `dot_shaped_flops` at
peak and its kernels by `unfused_kernel_bytes` at the measured share of the bandwidth, neither
fitted, in place of `dot_flops` at `Efficiency.dot` and `kernel_bytes` at `.memory`; the
elementwise rates stay fitted (the fusion they fold in is what the roofline check,
`trn_accum.analysis.roofline`, finds the module alone does not tell).

`price(features, peak, hbm, eff)`: seconds = dot_flops / (peak x dot) + kernel_bytes / (hbm x
memory) + elementwise_bytes / (hbm x elementwise) + loop_elementwise_bytes / (hbm x
loop_elementwise) + offchip_elementwise_bytes / (hbm x offchip_elementwise) + kernels x
kernel_s + loop_iterations x loop_iter_s (with rates:
dot_shaped_flops / peak and unfused_kernel_bytes / (hbm x bandwidth) in place of the first
two), linear in the inverse efficiencies, which is what lets `benchmarks/calibrate.py` fit them
by non-negative least squares on measured steps. Collectives are not priced here
(`trn_accum.analysis.steptime`).

Stdlib only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from trn_accum.analysis.collectives import COLLECTIVE_KINDS
from trn_accum.analysis.hlo.fusion import FUSIBLE
from trn_accum.analysis.hlo.module import HloModule, Instruction
from trn_accum.analysis.hlo.text import names_in
from trn_accum.analysis.rates import Rates, dot_efficiency, dot_shape

__all__ = [
    "FEATURES",
    "FREE_OPS",
    "KERNEL_OPS",
    "MOVE_OPS",
    "Efficiency",
    "applied_computations",
    "collective_kind",
    "dot_padded_flops",
    "is_noop_copy",
    "kernel_bytes",
    "op_features",
    "price",
]

FEATURES = (
    "dot_flops",
    "kernel_bytes",
    "elementwise_bytes",
    "loop_elementwise_bytes",
    "kernels",
    "loop_iterations",
    "dot_shaped_flops",
    "unfused_kernel_bytes",
    "offchip_elementwise_bytes",
)

#: Ops that compute nothing at run time (layout, bookkeeping, control).
FREE_OPS = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "reshape",
        "broadcast",
        "iota",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "call",
        "conditional",
        "while",
        "domain",
        "add-dependency",
        "get-dimension-size",
        "rng-get-and-update-state",
    }
)
#: Memory-moving ops that stay kernels of their own: (bytes read + written) per run.
MOVE_OPS = frozenset({"transpose", "copy", "concatenate", "pad", "slice", "reverse"})
KERNEL_OPS = frozenset(
    {
        "dot",
        "convolution",
        "reduce",
        "reduce-window",
        "gather",
        "scatter",
        "dynamic-slice",
        "dynamic-update-slice",
        "sort",
        "select-and-scatter",
        "custom-call",
        "fusion",
        "fft",
        "rng",
        "rng-bit-generator",
        "cholesky",
        "triangular-solve",
    }
)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What a platform achieves: `dot` of peak on tile-padded dot FLOPs, `memory` of the HBM
    bandwidth on kernel bytes, `elementwise` / `loop_elementwise` of it on elementwise result
    bytes outside / inside loops, seconds per
    kernel launch and per loop iteration; `tile`: the matrix unit's side; `source`: where the
    values come from (fitted rows or a document); `onchip_bytes`: the core's on-chip memory
    for buffers (inf: not stated, no result counts as off chip) and `offchip_elementwise`: the
    extra price of an elementwise result byte that does not fit in it, as a multiple of the HBM
    bandwidth (inf: no extra)."""

    dot: float
    memory: float
    elementwise: float
    loop_elementwise: float
    kernel_s: float
    loop_iter_s: float
    tile: int = 128
    source: str = ""
    rates: Rates | None = None
    onchip_bytes: float = math.inf
    offchip_elementwise: float = math.inf

    def coefficients(self, peak_flops: float, hbm_bytes_s: float) -> dict[str, float]:
        """Seconds per unit of each of `FEATURES` (see the module docstring for `rates`)."""
        r = self.rates
        return {
            "dot_flops": 0.0 if r else 1.0 / (peak_flops * self.dot),
            "kernel_bytes": 0.0 if r else 1.0 / (hbm_bytes_s * self.memory),
            "elementwise_bytes": 1.0 / (hbm_bytes_s * self.elementwise),
            "loop_elementwise_bytes": 1.0 / (hbm_bytes_s * self.loop_elementwise),
            "kernels": self.kernel_s,
            "loop_iterations": self.loop_iter_s,
            "dot_shaped_flops": 1.0 / peak_flops if r else 0.0,
            "unfused_kernel_bytes": 1.0 / (hbm_bytes_s * r.bandwidth) if r else 0.0,
            "offchip_elementwise_bytes": 1.0 / (hbm_bytes_s * self.offchip_elementwise),
        }

    @classmethod
    def from_coefficients(
        cls, c: Mapping[str, float], peak_flops: float, hbm_bytes_s: float, **kw
    ) -> Efficiency:
        """The inverse of `coefficients` (a zero coefficient: efficiency 1e9, i.e. free)."""

        def inv(x: float, scale: float) -> float:
            return 1e9 if x <= 0 else 1.0 / (x * scale)

        return cls(
            dot=inv(c["dot_flops"], peak_flops),
            memory=inv(c["kernel_bytes"], hbm_bytes_s),
            elementwise=inv(c["elementwise_bytes"], hbm_bytes_s),
            loop_elementwise=inv(c["loop_elementwise_bytes"], hbm_bytes_s),
            kernel_s=c["kernels"],
            loop_iter_s=c["loop_iterations"],
            offchip_elementwise=inv(c.get("offchip_elementwise_bytes", 0.0), hbm_bytes_s),
            **kw,
        )


def _padded(n: int, tile: int) -> int:
    return max(tile, math.ceil(n / tile) * tile) if n > 0 else 0


def dot_padded_flops(module: HloModule, ins: Instruction, tile: int) -> float:
    """2 x batch x M x N x K of one dot (`rates.dot_shape`), M, N and K each padded to `tile`
    (0 if the operand shapes are unknown)."""
    batch, m, n, k = dot_shape(module, ins)
    return 2.0 * batch * _padded(m, tile) * _padded(n, tile) * _padded(k, tile)


def _operand_bytes(module: HloModule, ins: Instruction) -> int:
    return sum(o.result_bytes for o in module.operand_instructions(ins))


def is_noop_copy(module: HloModule, ins: Instruction) -> bool:
    """A copy to its operand's own type and layout (see the module docstring)."""
    ops = module.operand_instructions(ins)
    return len(ops) == 1 and ops[0].type_text.strip() == ins.type_text.strip()


def collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start").removesuffix("-done")
    return base if base in COLLECTIVE_KINDS else None


_KERNEL_BYTES_OPS = frozenset(
    {"reduce", "reduce-window", "sort", "dynamic-update-slice", "scatter", "select-and-scatter"}
    | {"gather", "dynamic-slice", "custom-call", "fusion"}
    | MOVE_OPS
)


def kernel_bytes(module: HloModule, ins: Instruction) -> int:
    """HBM bytes one run of a memory-moving kernel moves (see the module docstring):
    reductions and sorts read their operands and write their result; a dynamic update or
    scatter reads and writes its update; gathers, slices, moves and custom calls read and
    write their result's size."""
    op = ins.opcode
    if op in ("reduce", "reduce-window", "sort"):
        return _operand_bytes(module, ins) + ins.result_bytes
    if op in ("dynamic-update-slice", "scatter", "select-and-scatter"):
        upd = module.operand_instructions(ins)[1:2] if op == "dynamic-update-slice" else ()
        return 2 * (upd[0].result_bytes if upd else ins.result_bytes)
    return 2 * ins.result_bytes


def applied_computations(module: HloModule) -> frozenset[str]:
    """Computations that run inside another op (reducers, comparators, scatter combiners,
    fusion bodies): their instructions are that op's, not kernels of their own."""
    names: set[str] = set()
    for ins in module.instructions():
        for key in ("to_apply", "select", "scatter", "calls", "comparator"):
            if key in ins.attrs and ins.opcode not in ("call", "async-start"):
                names.update(names_in(ins.attrs[key], bare_ok=True))
    return frozenset(module.reachable_from(*names)) if names else frozenset()


def op_features(
    module: HloModule,
    tile: int = 128,
    rates: Rates | None = None,
    onchip_bytes: float = math.inf,
) -> dict[str, float]:
    """The `FEATURES` of one step of `module` per device (see the module docstring;
    `dot_shaped_flops` 0 without `rates`, `offchip_elementwise_bytes` 0 without
    `onchip_bytes`); plus "unknown_trips": ops in loops of unknown trip count (counted once)."""
    out = dict.fromkeys(FEATURES, 0.0)
    unknown = 0
    inner = applied_computations(module)
    for ins in module.instructions():
        op = ins.opcode
        if (op in FREE_OPS and op != "while") or ins.computation in inner:
            continue
        mult = module.trip_multiplier(ins.computation)
        if mult is None:
            unknown += 1
            mult = 1
        if op == "while":
            trips = ins.trip_count or module.counted_trips(ins)
            out["loop_iterations"] += mult * (trips or 1)
            continue
        if collective_kind(op) is not None or op.endswith("-done") or op == "async-done":
            continue  # collectives: trn_accum.analysis.steptime
        if (op == "copy" and is_noop_copy(module, ins)) or ins.names_sharding_only:
            continue
        if op in ("dot", "convolution"):
            flops = dot_padded_flops(module, ins, tile)
            out["dot_flops"] += mult * flops
            if rates is not None and flops:
                out["dot_shaped_flops"] += (
                    mult * flops / dot_efficiency(rates, *dot_shape(module, ins))
                )
        elif op in _KERNEL_BYTES_OPS:
            out["kernel_bytes"] += mult * kernel_bytes(module, ins)
            if op in KERNEL_OPS and op not in FUSIBLE and op not in ("reduce", "reduce-window"):
                out["unfused_kernel_bytes"] += mult * kernel_bytes(module, ins)
        else:
            key = "loop_elementwise_bytes" if module.in_loop(ins) else "elementwise_bytes"
            out[key] += mult * ins.result_bytes
            if ins.result_bytes >= onchip_bytes:
                out["offchip_elementwise_bytes"] += mult * ins.result_bytes
        if op in KERNEL_OPS:
            out["kernels"] += mult
    out["unknown_trips"] = unknown
    return out


def price(
    features: Mapping[str, float], peak_flops: float, hbm_bytes_s: float, eff: Efficiency
) -> dict[str, float]:
    """{feature: seconds} of `features` at `eff` and "total_s"."""
    coef = eff.coefficients(peak_flops, hbm_bytes_s)
    out = {f"{f}_s": features.get(f, 0.0) * coef[f] for f in FEATURES}
    out["total_s"] = sum(out.values())
    return out
