"""Collectives of a compiled module: what runs, how many bytes, over which mesh axes.

`collectives(module)` lists every collective (all-reduce, all-gather, all-to-all,
collective-permute, reduce-scatter, plus ragged-all-to-all and collective-broadcast; async
`-start`/`-done` pairs once), each with its replica groups decoded from any printed form
(`parse_replica_groups`), the bytes of its result, whether it runs in a loop and how many times
per step. `group_axes` maps replica groups back to mesh axis names; `count_collectives` sums
them inside / outside loops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trn_accum.analysis.hlo.module import HloModule, Instruction, parse_hlo
from trn_accum.analysis.hlo.replica_groups import (
    group_axes,
    parse_replica_groups,
    parse_source_target_pairs,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "MAIN_COLLECTIVES",
    "Collective",
    "collectives",
    "converted_from_narrow",
    "count_collectives",
    "group_axes",
    "parse_replica_groups",
    "parse_source_target_pairs",
]

#: Collective opcodes (synchronous spelling). Async forms `<kind>-start`/`<kind>-done` map to these.
COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "ragged-all-to-all",
    "collective-broadcast",
)
#: The five the accumulation tests and benchmarks report.
MAIN_COLLECTIVES = COLLECTIVE_KINDS[:5]


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective op as it runs: one per sync op or async start/done pair.

    kind: one of COLLECTIVE_KINDS. replica_groups: tuple of device-id tuples (None when the op
    has source_target_pairs instead). bytes: bytes of the op's result array(s) on one device
    (all-gather: the gathered result; reduce-scatter: the scattered result).
    trip_multiplier: how many times the op runs per program execution (product of the known
    trip counts of the enclosing loops; None if one is unknown).
    """

    kind: str
    instruction: Instruction
    computation: str
    in_loop: bool
    replica_groups: tuple[tuple[int, ...], ...] | None
    source_target_pairs: tuple[tuple[int, int], ...] | None
    bytes: int
    trip_multiplier: int | None
    native_bytes: int = -1  # bytes at the partitioner's dtype (`native_bytes`); -1 = `bytes`

    @property
    def wire_bytes_source(self) -> int:
        """The result bytes a backend without XLA:CPU's float promotion moves (see
        `native_bytes`)."""
        return self.bytes if self.native_bytes < 0 else self.native_bytes


#: Float types XLA:CPU widens to float32 around collectives (`all-reduce-promotion` for
#: all-reduce / reduce-scatter; `float-normalization-bf16` for the rest: its all-reduce thunk
#: has no bfloat16, "UNIMPLEMENTED: AllReduce for datatype 'bf16'"), 2 bytes an element.
_PROMOTED = ("bf16", "f16")


def converted_from_narrow(module: HloModule, ins: Instruction) -> bool:
    """True when `ins` is a convert of a bfloat16 / float16 value, or a fusion whose root is
    one (through bitcasts / reshapes / copies / transposes): the value is exactly
    representable in 2 bytes and the widening is the backend's."""
    if ins.opcode == "fusion":
        for name in ins.called_computations:
            comp = module.computations.get(name)
            root = comp.root if comp is not None else None
            if root is not None and converted_from_narrow(module, root):
                return True
        return False
    ops = module.operand_instructions(ins)
    if ins.opcode in _LAYOUT_ONLY and len(ops) == 1:
        return converted_from_narrow(module, ops[0])
    if ins.opcode != "convert":
        return False
    return bool(ops) and bool(ops[0].shapes) and ops[0].dtypes <= set(_PROMOTED)


_LAYOUT_ONLY = ("bitcast", "reshape", "copy", "transpose")  # move elements, keep their values


def native_bytes(module: HloModule, ins: Instruction, nbytes: int) -> int:
    """The bytes of a collective at the dtype the SPMD partitioner gave it.

    XLA:CPU widens 2-byte float collectives to float32 after partitioning (checked on the
    passes' dumps, `--xla_dump_hlo_pass_re`: the same collectives are bf16 before, f32 after):
    - a reduction (all-reduce, reduce-scatter) gets a reducer named `*promoted*` (pass
      `all-reduce-promotion`): priced at 2 bytes an element.
    - a combined (tuple) collective, reduction or not, whose combiner merged bf16 and f32
      operands into one f32 tuple: element by element, each float32 element whose operand is
      a widened 2-byte float at 2 bytes, every other element at its own dtype.
    - a data movement (all-gather, all-to-all, permute) of a value that is a widened 2-byte
      float (its operand a convert from bf16, `float-normalization-bf16`): 2 bytes an element,
      lossless, what a backend with 2-byte collectives (Neuron) moves.
    Everything else keeps `nbytes`.
    """
    if "f32" not in ins.dtypes:
        return nbytes
    kind = _collective_kind(ins.opcode)
    ops = module.operand_instructions(ins)
    arrays = [a for a in ins.shapes if a.dims or not ins.is_tuple]
    if ins.is_tuple and len(ops) == len(arrays):  # a combined collective: operand by operand
        # each element in its own dtype: a float32 element fed by a convert of a bf16 value
        # is the backend's widening (reductions and data movement alike), any other float32
        # element is the program's
        return sum(
            a.nbytes // 2 if a.dtype == "f32" and converted_from_narrow(module, o) else a.nbytes
            for a, o in zip(arrays, ops, strict=True)
        )
    if kind in ("all-reduce", "reduce-scatter"):
        return nbytes // 2 if "promoted" in (ins.attrs.get("to_apply") or "") else nbytes
    if len(ins.dtypes) == 1 and ops and all(converted_from_narrow(module, o) for o in ops):
        return nbytes // 2
    return nbytes


def _collectives(module: HloModule) -> list[Collective]:
    done_of: dict[str, Instruction] = {}
    for ins in module.instructions():
        if ins.opcode.endswith("-done") or ins.opcode == "async-done":
            for o in ins.operands:
                done_of[o] = ins
    out = []
    for ins in module.instructions():
        kind = _collective_kind(ins.opcode)
        if kind is None or ins.opcode.endswith("-done"):
            continue
        nbytes = ins.result_bytes
        if ins.opcode.endswith("-start"):
            done = done_of.get(ins.name)
            nbytes = done.result_bytes if done is not None else _start_bytes(ins, kind)
        groups = None
        pairs = None
        if "source_target_pairs" in ins.attrs:
            pairs = parse_source_target_pairs(ins.attrs["source_target_pairs"])
        if kind != "collective-permute":
            groups = parse_replica_groups(
                ins.attrs.get("replica_groups", "{}"),
                num_devices=module.num_partitions * module.replica_count,
            )
        out.append(
            Collective(
                kind=kind,
                instruction=ins,
                computation=ins.computation,
                in_loop=module.in_loop(ins),
                replica_groups=groups,
                source_target_pairs=pairs,
                bytes=nbytes,
                trip_multiplier=module.trip_multiplier(ins.computation),
                native_bytes=native_bytes(module, ins, nbytes),
            )
        )
    return out


def _collective_kind(opcode: str) -> str | None:
    base = opcode
    for suffix in ("-start", "-done"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base if base in COLLECTIVE_KINDS else None


def _start_bytes(ins: Instruction, kind: str) -> int:
    # An async start without a visible done: its tuple holds (operands..., results..., ctx).
    arrays = [a for a in ins.shapes if a.dtype not in ("u32", "s32") or a.dims]
    if ins.is_tuple and len(arrays) >= 2:
        return arrays[len(arrays) // 2].nbytes if kind != "all-reduce" else arrays[-1].nbytes
    return ins.result_bytes


# ----------------------------------------------------------------------------- helpers


def _as_module(hlo: str | HloModule) -> HloModule:
    return hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)


def collectives(hlo: str | HloModule) -> list[Collective]:
    """Every collective of a compiled module (HLO text or HloModule); async pairs once."""
    return _collectives(_as_module(hlo))


def count_collectives(
    hlo: str | HloModule, kinds: Sequence[str] = COLLECTIVE_KINDS
) -> dict[str, dict]:
    """Collective counts and bytes, split by where they run.

    Returns {"outside_loops": {kind: n}, "inside_loops": {kind: n}, "total": {kind: n},
    "bytes_outside_loops": {kind: bytes}, "bytes_inside_loops": {kind: bytes}} with every kind
    in `kinds` present (0 if absent). "inside_loops" = ops in computations reached from a while
    body or condition (per loop iteration, not multiplied by the trip count).
    """
    out: dict[str, dict] = {
        k: dict.fromkeys(kinds, 0)
        for k in (
            "outside_loops",
            "inside_loops",
            "total",
            "bytes_outside_loops",
            "bytes_inside_loops",
        )
    }
    for c in _collectives(_as_module(hlo)):
        if c.kind not in out["total"]:
            continue
        where = "inside_loops" if c.in_loop else "outside_loops"
        out[where][c.kind] += 1
        out["bytes_" + where][c.kind] += c.bytes
        out["total"][c.kind] += 1
    return out
