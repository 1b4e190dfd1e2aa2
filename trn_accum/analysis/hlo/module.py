"""Read the text of a compiled (partitioned) HLO module: computations, instructions, loops.

Stdlib only. Input is `jax.jit(f).lower(*args).compile().as_text()` (what XLA runs, after SPMD
partitioning), so collectives are visible. What this module answers:

- every instruction with the computation it lives in (`HloModule.instructions()`), its opcode,
  result dtypes/shapes/bytes, operands and raw attributes;
- which computations run inside a `while` loop (`HloModule.loop_computations`): the bodies and
  conditions of every while and, transitively, everything they call (fusions, reducers, nested
  loops, async wrappers), found by computation membership, never by instruction names;
- the collectives (`collectives()`, `count_collectives()`): all-reduce, all-gather, all-to-all,
  collective-permute, reduce-scatter (plus ragged-all-to-all and collective-broadcast), the async
  `-start`/`-done` pairs counted once, each with its replica groups decoded from any of the
  printed forms and the bytes of its result.

Replica-group forms handled (`trn_accum.analysis.hlo.replica_groups.parse_replica_groups`):

- explicit lists `{{0,1},{2,3}}`; `{}` = one group of every device;
- iota lists `[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)` (groups × group size, from a transposed iota);
- mesh-axes lists, what jax 0.10 / XLA print for both Shardy and GSPMD:
  `mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}`, including
  sub-axes `{'a':(1)2}` and meshes without `device_ids` (plain iota).

Device ids in SPMD programs are partition ids, i.e. positions in the mesh's flattened device
array (`mesh.devices.flat`); `group_axes` maps groups back to mesh axis names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from trn_accum.analysis.hlo.ir import Computation, Instruction
from trn_accum.analysis.hlo.text import (
    ArrayType,
    match_close,
    names_in,
    operand_names,
    parse_attrs,
    parse_type,
    split_top_level,
)

__all__ = [
    "ArrayType",
    "Computation",
    "HloModule",
    "Instruction",
    "dot_flops",
    "parse_hlo",
    "parse_type",
]


class HloModule:
    """A parsed HLO module. Build with `parse_hlo(text)`."""

    def __init__(self, name: str, header: Mapping[str, str], computations: Sequence[Computation]):
        self.name = name
        self.header = dict(header)
        self.computations: dict[str, Computation] = {c.name: c for c in computations}
        entries = [c.name for c in computations if c.is_entry]
        if len(entries) != 1:
            raise ValueError(f"HLO module {name!r}: expected one ENTRY computation, got {entries}")
        self.entry = entries[0]
        self._by_name: dict[str, Instruction] = {}
        for comp in computations:
            for ins in comp.instructions:
                self._by_name.setdefault(ins.name, ins)
        self._add_tuple_element_reads()
        self._callees = {
            c.name: tuple(
                n
                for ins in c.instructions
                for n in ins.called_computations
                if n in self.computations
            )
            for c in computations
        }
        self.reachable = self.reachable_from(self.entry)
        self.loop_computations = self._find_loop_computations()
        self._multipliers = self._trip_multipliers()

    def _add_tuple_element_reads(self) -> None:
        """XLA as of jaxlib 0.11 prints a read of tuple element i of `%t` as the operand
        `%t#i`, where older XLA printed a get-tuple-element instruction. Each such operand is
        made that instruction here, found by name only (the computations' instructions and
        their counts are what was printed), so operand chains read alike in both forms."""
        for ins in list(self._by_name.values()):
            for op in ins.operands:
                base, sep, index = op.rpartition("#")
                src = self._by_name.get(base)
                if not sep or not index.isdigit() or src is None or op in self._by_name:
                    continue
                elements = split_top_level(src.type_text.strip()[1:-1]) if src.is_tuple else []
                t = elements[int(index)].strip() if int(index) < len(elements) else ""
                t = re.sub(r"/\*.*?\*/", "", t).strip()
                self._by_name[op] = Instruction(
                    name=op,
                    opcode="get-tuple-element",
                    computation=src.computation,
                    type_text=t,
                    shapes=parse_type(t),
                    operands=(base,),
                    operand_text=f"%{base}",
                    attrs={"index": index},
                    is_root=False,
                    line=f"%{op} = {t} get-tuple-element(%{base}), index={index}",
                )

    # -- structure ---------------------------------------------------------------------

    @property
    def num_partitions(self) -> int:
        return int(self.header.get("num_partitions", 1))

    @property
    def replica_count(self) -> int:
        return int(self.header.get("replica_count", 1))

    def reachable_from(self, *roots: str) -> frozenset[str]:
        """Computations reachable from `roots` through calls, roots included."""
        seen: set[str] = set()
        stack = [r for r in roots if r in self.computations]
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            stack.extend(self._callees.get(c, ()))
        return frozenset(seen)

    def while_loops(self) -> list[Instruction]:
        """Every reachable `while` instruction."""
        return [i for i in self.instructions() if i.opcode == "while"]

    def _find_loop_computations(self) -> frozenset[str]:
        roots = []
        for ins in self.instructions():
            if ins.opcode == "while":
                for key in ("body", "condition"):
                    if key in ins.attrs:
                        roots.extend(names_in(ins.attrs[key], bare_ok=True))
        return self.reachable_from(*roots)

    def _trip_multipliers(self) -> dict[str, int | None]:
        # A computation runs once per run of each of its call sites, so its multiplier is the
        # sum over its callers (unknown wins): JAX shares one computation among the call sites
        # of a function (e.g. a remat'd step called from each layer's scan), and each of those
        # runs it. Computed in callers-first order; call graphs of XLA modules are DAGs. A site
        # naming one computation twice (a conditional's equal branches) runs it once.
        mult: dict[str, int | None] = {self.entry: 1}
        for cname in self._topological_order():
            if cname not in mult:
                continue
            base = mult[cname]
            for ins in self.computations[cname].instructions:
                factor: int | None = 1
                if ins.opcode == "while":
                    factor = ins.trip_count or self.counted_trips(ins)
                if ins.opcode in ("async-update", "async-done"):
                    continue  # the same run of the computation its async-start calls
                m = None if base is None or factor is None else base * factor
                for callee in dict.fromkeys(ins.called_computations):
                    if callee not in self.computations:
                        continue
                    if callee in mult:
                        old = mult[callee]
                        mult[callee] = None if old is None or m is None else old + m
                    else:
                        mult[callee] = m
        return mult

    def _topological_order(self) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(c: str) -> None:
            stack = [(c, iter(self._callees.get(c, ())))]
            state[c] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    stack.pop()
                    state[node] = 2
                    order.append(node)
                elif state.get(nxt, 0) == 0:
                    state[nxt] = 1
                    stack.append((nxt, iter(self._callees.get(nxt, ()))))

        visit(self.entry)
        return order[::-1]

    def counted_trips(self, loop: Instruction) -> int | None:
        """Trip count of a `while` without a known_trip_count (a module before XLA's loop
        analysis, e.g. right after SPMD partitioning): its condition's root is
        `compare(get-tuple-element(param, i), constant(N)), direction=LT` and the loop's init
        tuple holds a constant c at i (each maybe through copies): N - c trips. None for any
        other shape."""
        cond = self.computations.get(names_in(loop.attrs.get("condition", ""), bare_ok=True)[0])
        root = cond.root if cond is not None else None
        if root is None or root.opcode != "compare" or "direction=LT" not in root.line:
            return None
        ops = [self._through_copies(o) for o in self.operand_instructions(root)]
        if len(ops) != 2 or ops[0].opcode != "get-tuple-element" or ops[1].opcode != "constant":
            return None
        init = self.operand_instructions(loop)
        init = self.operand_instructions(init[0]) if init and init[0].opcode == "tuple" else ()
        index = int(ops[0].attrs.get("index", "-1"))
        start = self._through_copies(init[index]) if 0 <= index < len(init) else None
        if start is None or start.opcode != "constant":
            return None
        try:
            return int(_constant(ops[1])) - int(_constant(start))
        except ValueError:
            return None

    def _through_copies(self, ins: Instruction) -> Instruction:
        """The value a chain of copies / bitcasts / reshapes of one operand starts from."""
        while ins.opcode in ("copy", "bitcast", "reshape") and len(ins.operands) == 1:
            ops = self.operand_instructions(ins)
            if not ops:
                break
            ins = ops[0]
        return ins

    def trip_multiplier(self, computation: str) -> int | None:
        return self._multipliers.get(computation)

    # -- instructions ------------------------------------------------------------------

    def instructions(self, *, include_unreachable: bool = False) -> Iterator[Instruction]:
        """Every instruction (each knows its `.computation`), entry computation last."""
        for comp in self.computations.values():
            if include_unreachable or comp.name in self.reachable:
                yield from comp.instructions

    def instruction(self, name: str) -> Instruction:
        return self._by_name[name.lstrip("%")]

    def operand_instructions(self, ins: Instruction) -> tuple[Instruction, ...]:
        return tuple(self._by_name[o] for o in ins.operands if o in self._by_name)

    def in_loop(self, ins_or_computation: Instruction | str) -> bool:
        """True if the instruction (or computation) runs inside a while body or condition."""
        c = (
            ins_or_computation.computation
            if isinstance(ins_or_computation, Instruction)
            else ins_or_computation
        )
        return c in self.loop_computations

    def loop_parts(self, loop: Instruction) -> tuple[Computation, Computation]:
        """(body, condition) computations of a `while` instruction."""
        body = names_in(loop.attrs["body"], bare_ok=True)[0]
        cond = names_in(loop.attrs["condition"], bare_ok=True)[0]
        return self.computations[body], self.computations[cond]

    def find(self, opcode: str | Iterable[str]) -> list[Instruction]:
        """Every reachable instruction with one of these opcodes."""
        ops = {opcode} if isinstance(opcode, str) else set(opcode)
        return [i for i in self.instructions() if i.opcode in ops]


def dot_flops(module: HloModule) -> dict[str, Any]:
    """Dot FLOPs per device from a compiled module: once each (`once`) and multiplied by the
    trip counts of the loops they sit in (`with_trips`); `unknown_trips` counts dots in loops
    of unknown trip count (taken once)."""
    once = with_trips = 0
    unknown = 0
    for ins in module.instructions():
        if ins.opcode != "dot" or not ins.shapes:
            continue
        ops = module.operand_instructions(ins)
        if not ops or not ops[0].shapes:
            continue
        lhs = ops[0].shapes[0].dims
        contracting = [
            int(x) for x in re.findall(r"\d+", ins.attrs.get("lhs_contracting_dims", ""))
        ]
        k = math.prod(lhs[i] for i in contracting if i < len(lhs))
        flops = 2 * ins.shapes[0].size * k
        mult = module.trip_multiplier(ins.computation)
        once += flops
        if mult is None:
            unknown += 1
            mult = 1
        with_trips += flops * mult
    return {"once": once, "with_trips": with_trips, "unknown_trips": unknown}


def _constant(ins: Instruction) -> str:
    """The literal of a scalar `constant(...)` instruction."""
    return ins.operand_text.strip()


# ----------------------------------------------------------------------------- parsing

# `name (params) -> type {` (compiled); `name {` (unoptimised, `lowered.as_text(dialect="hlo")`)
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*(?:\(.*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^\s*([A-Za-z][\w\-]*)\(")


def parse_hlo(text: str) -> HloModule:
    """Parse HLO text (as printed by `compiled.as_text()`, or unoptimised by
    `lowered.as_text(dialect="hlo")`) into an HloModule."""
    name = ""
    header: dict[str, str] = {}
    comps: list[Computation] = []
    cur_name: str | None = None
    cur_entry = False
    cur: list[Instruction] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line:
            continue
        if cur_name is None:
            if line.startswith("HloModule"):
                parts = split_top_level(line[len("HloModule") :].strip())
                if parts:
                    name = parts[0].strip()
                for p in parts[1:]:
                    k, _, v = p.partition("=")
                    header[k.strip()] = v.strip()
                continue
            m = _COMP_HEADER.match(line)
            if m and not line.startswith(" "):
                cur_name, cur_entry, cur = m.group(2), bool(m.group(1)), []
            continue
        if line.strip() == "}":
            comps.append(Computation(cur_name, cur_entry, tuple(cur)))
            cur_name = None
            continue
        ins = _parse_instruction(line, cur_name)
        if ins is not None:
            cur.append(ins)
    if cur_name is not None:
        raise ValueError(f"HLO text ends inside computation {cur_name!r}")
    if not comps:
        raise ValueError("no HLO computation found: pass compiled.as_text()")
    return HloModule(name, header, comps)


def _parse_instruction(line: str, computation: str) -> Instruction | None:
    m = _INSTR.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    rest = rest.strip()
    if rest.startswith("("):
        end = match_close(rest, 0)
        type_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    mo = _OPCODE.match(rest)
    if not mo:
        return None
    opcode = mo.group(1)
    open_idx = rest.index("(", mo.start(1))
    close_idx = match_close(rest, open_idx)
    operand_text = rest[open_idx + 1 : close_idx]
    attr_text = rest[close_idx + 1 :].lstrip().lstrip(",")
    attrs = parse_attrs(attr_text)
    operands = tuple(operand_names(operand_text))
    return Instruction(
        name=name,
        opcode=opcode,
        computation=computation,
        type_text=type_text,
        shapes=parse_type(type_text),
        operands=operands,
        operand_text=operand_text,
        attrs=attrs,
        is_root=is_root,
        line=line.strip(),
    )
