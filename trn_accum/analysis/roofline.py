"""A train step priced kernel by kernel, each at its own roofline, at rates measured on the chip:
the step-time model's check of what fusion leaves (`benchmarks/calibrate.py --roofline`).

Input: the module the backend receives (`trn_accum.analysis.hlo.partitioned`: shard shapes, the
dtypes the program wrote, nothing fused yet). `fusions(module)` fuses it by the rule the
memory estimate uses (`trn_accum.analysis.hlo.fusion.fused_into_users`: an elementwise-like
op read only by ops that take fused inputs has no buffer and runs inside each of them) and
returns one `Group` per kernel left, counted as many times as it runs
(`HloModule.trip_multiplier`):

- "dot": a dot with the fused producers of its operands: its FLOPs (M, N, K each padded to
  the matrix unit's tile, `pricing.dot_padded_flops`), its shape (batch, M, N, K), the bytes
  of the values it reads through those producers and of its result;
- "fused": an elementwise op that is written out, or a reduction, with its fused producers:
  the bytes of what it reads through them and of its result;
- "kernel": an op that stays a kernel of its own and moves memory (gathers, scatters,
  dynamic updates, sorts, custom calls): its bytes as `pricing.kernel_bytes` counts them.

Sharding names (`Instruction.names_sharding_only`), reshapes and bitcasts are walked through.

`seconds(groups, loop_iterations, peak, hbm, rates)`: the sum over kernels of count x max(FLOPs
/ (peak x the dot efficiency of its shape), bytes / (HBM bandwidth x the achieved share)), plus
every loop iteration at its measured cost; nothing fitted (`trn_accum.analysis.rates`).
Collectives are priced apart (`trn_accum.analysis.steptime`). `aggregate` stores the groups
compactly (one row per distinct group with its count).

Stdlib only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from trn_accum.analysis import pricing
from trn_accum.analysis.hlo.fusion import FUSIBLE, fused_into_users
from trn_accum.analysis.hlo.module import HloModule, Instruction
from trn_accum.analysis.rates import Rates, dot_efficiency, dot_shape

__all__ = ["Group", "aggregate", "from_rows", "fusions", "seconds"]


@dataclasses.dataclass(frozen=True)
class Group:
    """One fused group of ops: "dot", "fused" (elementwise ops and reductions) or "kernel";
    its FLOPs and bytes per run, its dot shape (batch, m, n, k; zeros otherwise) and how many
    times a step runs it."""

    kind: str
    flops: float
    bytes: float
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    count: float = 1.0


def _kernel_kind(module: HloModule, ins: Instruction) -> str | None:
    """ "dot", "fused" (an elementwise root or a reduction), "kernel" (an op that moves memory,
    `pricing.kernel_bytes`) or None: no work of its own (free ops, collectives, sharding
    names, no-op copies)."""
    op = ins.opcode
    if op in pricing.FREE_OPS or pricing.collective_kind(op) or op.endswith("-done"):
        return None
    if ins.names_sharding_only or (op == "copy" and pricing.is_noop_copy(module, ins)):
        return None
    if op in ("dot", "convolution"):
        return "dot"
    if op in FUSIBLE or op in ("reduce", "reduce-window"):
        return "fused"
    return "kernel"


def _users(module: HloModule, inner: frozenset[str]) -> dict[str, list[Instruction]]:
    """{name: the ops that read it}, sharding names walked through (they are not ops)."""
    direct: dict[str, list[Instruction]] = {}
    for ins in module.instructions():
        if ins.computation in inner:
            continue
        for name in dict.fromkeys(o.split("#")[0] for o in ins.operands):
            direct.setdefault(name, []).append(ins)

    def walk(name: str) -> list[Instruction]:
        out = []
        for u in direct.get(name, ()):
            out.extend(walk(u.name) if u.names_sharding_only else [u])
        return out

    return {name: walk(name) for name in direct}


def fusions(module: HloModule, tile: int = 128) -> list[Group]:
    """The step's kernels after fusion (see the module docstring), one `Group` per kernel with
    its trip count as `count` (1 for ops in loops of unknown trip count)."""
    inner = pricing.applied_computations(module)
    users = _users(module, inner)

    def fused(ins: Instruction) -> bool:
        return fused_into_users(ins, [u.opcode for u in users.get(ins.name, ())])

    memo: dict[str, dict[str, int]] = {}

    def reads(ins: Instruction) -> dict[str, int]:
        """{value: bytes} the kernel `ins` roots reads, through its fused producers (dots are
        never fused into a user: each is a kernel of its own)."""
        if ins.name not in memo:
            out: dict[str, int] = {}
            for op in module.operand_instructions(ins):
                if op.opcode in ("constant", "iota"):
                    continue
                if op.names_sharding_only or fused(op) or op.opcode in ("reshape", "bitcast"):
                    out.update(reads(op))
                else:
                    out[op.name.split("#")[0]] = op.result_bytes
            memo[ins.name] = out
        return memo[ins.name]

    groups: list[Group] = []
    for ins in module.instructions():
        if ins.computation in inner or fused(ins):
            continue
        kind = _kernel_kind(module, ins)
        if kind is None:
            continue
        if ins.opcode in pricing.KERNEL_OPS and kind == "kernel":
            groups.append(_counted(module, ins, kind, 0.0, pricing.kernel_bytes(module, ins)))
            continue
        flops, shape = 0.0, (0, 0, 0, 0)
        if kind == "dot":
            flops, shape = pricing.dot_padded_flops(module, ins, tile), dot_shape(module, ins)
        nbytes = sum(reads(ins).values()) + ins.result_bytes
        groups.append(_counted(module, ins, kind, flops, nbytes, shape))
    return groups


def _counted(module, ins, kind, flops, nbytes, shape=(0, 0, 0, 0)) -> Group:
    mult = module.trip_multiplier(ins.computation)
    return Group(kind, float(flops), float(nbytes), tuple(shape), float(mult or 1))


def aggregate(groups: Iterable[Group]) -> list[list]:
    """[kind, flops, bytes, batch, m, n, k, count] per distinct group, counts summed: the form
    `benchmarks/calibration.json` stores (`from_rows` reads it back)."""
    out: dict[tuple, float] = {}
    for g in groups:
        key = (g.kind, g.flops, g.bytes, *g.shape)
        out[key] = out.get(key, 0.0) + g.count
    return [[*key, count] for key, count in sorted(out.items())]


def from_rows(rows: Iterable[Sequence]) -> list[Group]:
    """The groups of `aggregate`'s rows."""
    return [
        Group(r[0], float(r[1]), float(r[2]), tuple(int(x) for x in r[3:7]), float(r[7]))
        for r in rows
    ]


def seconds(
    groups: Iterable[Group],
    loop_iterations: float,
    peak_flops: float,
    hbm_bytes_s: float,
    rates: Rates,
) -> dict[str, float]:
    """{"dot_s", "fused_s", "kernel_s", "loop_s", "total_s"}: each group at its roofline (see the
    module docstring), and of the dots' time "dot_bound_s", the part where FLOPs bound them."""
    out = dict.fromkeys(("dot_s", "fused_s", "kernel_s", "loop_s", "dot_bound_s"), 0.0)
    bw = hbm_bytes_s * rates.bandwidth
    for g in groups:
        t_bytes = g.bytes / bw
        if g.kind == "dot":
            eff = dot_efficiency(rates, *g.shape) if g.shape[1] else 1.0
            t_flops = g.flops / (peak_flops * max(eff, 1e-3))
            out["dot_s"] += g.count * max(t_flops, t_bytes)
            out["dot_bound_s"] += g.count * t_flops if t_flops >= t_bytes else 0.0
        else:
            out[f"{g.kind}_s"] += g.count * t_bytes
    out["loop_s"] = loop_iterations * rates.loop_iter_s
    out["total_s"] = out["dot_s"] + out["fused_s"] + out["kernel_s"] + out["loop_s"]
    return out
