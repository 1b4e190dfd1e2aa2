"""Read the text of a compiled (partitioned) HLO module: computations, instructions, loops,
collectives.

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

Replica-group forms handled (`parse_replica_groups`):

- explicit lists `{{0,1},{2,3}}`; `{}` = one group of every device;
- iota lists `[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)` (groups × group size, from a transposed iota);
- mesh-axes lists, what jax 0.10 / XLA print for both Shardy and GSPMD:
  `mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}`, including
  sub-axes `{'a':(1)2}` and meshes without `device_ids` (plain iota).

Device ids in SPMD programs are partition ids, i.e. positions in the mesh's flattened device
array (`mesh.devices.flat`); `group_axes` maps groups back to mesh axis names.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

__all__ = [
    "COLLECTIVE_KINDS",
    "ArrayType",
    "Collective",
    "Computation",
    "HloModule",
    "Instruction",
    "collectives",
    "count_collectives",
    "group_axes",
    "parse_hlo",
    "parse_replica_groups",
    "parse_source_target_pairs",
    "parse_type",
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

# Bytes per element; sub-byte types are rounded up per array in `ArrayType.nbytes`.
_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}
_F8 = re.compile(r"^f8e\w+$|^f4e\w+$|^f6e\w+$|^f8$")

# Attributes whose values name called computations.
_CALL_ATTRS = (
    "to_apply",
    "body",
    "condition",
    "calls",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
    "select",
    "scatter",
    "async_wrapped_computation",
)


# ----------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array in a result type: dtype ("f32", "bf16", "pred", "token", ...) and dims.

    Dynamic dims printed as `<=N` are taken at their bound N.
    """

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        bits = _DTYPE_BITS.get(self.dtype)
        if bits is None:
            bits = 8 if _F8.match(self.dtype) else 0
            if bits == 0 and self.dtype.startswith("f"):
                # Unknown float type: take the digits as the bit width (e.g. "f8e3m4").
                m = re.match(r"f(\d+)", self.dtype)
                bits = int(m.group(1)) if m else 0
        return (self.size * bits + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_type(text: str) -> tuple[ArrayType, ...]:
    """Flattened leaves of an HLO type: `f32[4,8]{1,0}` or `(f32[4], (s32[], u32[]))`."""
    out = []
    # Drop comments such as /*index=5*/ and layouts (braces) before matching arrays.
    text = re.sub(r"/\*.*?\*/", "", text)
    text = _strip_braces(text)
    for m in _ARRAY_RE.finditer(text):
        dims = []
        for d in m.group(2).split(","):
            d = d.strip()
            if not d:
                continue
            dims.append(int(d.lstrip("<=").strip()))
        out.append(ArrayType(m.group(1), tuple(dims)))
    return tuple(out)


def _strip_braces(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


# ----------------------------------------------------------------------------- IR


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction. `attrs` holds the raw attribute text by key (e.g.
    attrs["replica_groups"], attrs["to_apply"], attrs["custom_call_target"])."""

    name: str
    opcode: str
    computation: str
    type_text: str
    shapes: tuple[ArrayType, ...]
    operands: tuple[str, ...]
    operand_text: str
    attrs: Mapping[str, str]
    is_root: bool
    line: str

    @property
    def dtypes(self) -> frozenset[str]:
        return frozenset(a.dtype for a in self.shapes)

    @property
    def is_tuple(self) -> bool:
        return self.type_text.lstrip().startswith("(")

    @property
    def result_bytes(self) -> int:
        return sum(a.nbytes for a in self.shapes)

    @property
    def called_computations(self) -> tuple[str, ...]:
        """Computations this instruction calls (to_apply, body, condition, calls, branches...)."""
        names: list[str] = []
        for key, value in self.attrs.items():
            if key in _CALL_ATTRS:
                names.extend(_names_in(value, bare_ok=True))
            elif key not in ("metadata", "backend_config", "frontend_attributes", "sharding"):
                names.extend(_names_in(value, bare_ok=False))
        return tuple(dict.fromkeys(names))

    def attr(self, key: str, default: str | None = None) -> str | None:
        """An attribute's value with surrounding double quotes removed (e.g.
        `custom_call_target`)."""
        value = self.attrs.get(key)
        if value is None:
            return default
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1]
        return value

    @property
    def trip_count(self) -> int | None:
        """Known trip count of a `while` (from its backend_config), else None."""
        cfg = self.attrs.get("backend_config")
        if self.opcode != "while" or not cfg:
            return None
        try:
            data = json.loads(_unquote(cfg))
            return int(data["known_trip_count"]["n"])
        except (ValueError, KeyError, TypeError):
            m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', cfg)
            return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    @property
    def root(self) -> Instruction | None:
        for ins in self.instructions:
            if ins.is_root:
                return ins
        return self.instructions[-1] if self.instructions else None


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

    @property
    def group_size(self) -> int | None:
        if not self.replica_groups:
            return None
        return len(self.replica_groups[0])


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

    # -- structure ---------------------------------------------------------------------

    @property
    def num_partitions(self) -> int:
        return int(self.header.get("num_partitions", 1))

    @property
    def replica_count(self) -> int:
        return int(self.header.get("replica_count", 1))

    def callees(self, computation: str) -> tuple[str, ...]:
        return self._callees.get(computation, ())

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
                        roots.extend(_names_in(ins.attrs[key], bare_ok=True))
        return self.reachable_from(*roots)

    def _trip_multipliers(self) -> dict[str, int | None]:
        # Fixed point over the call graph: a computation's multiplier is the largest over its
        # callers (unknown wins). Call graphs of XLA modules are DAGs.
        mult: dict[str, int | None] = {self.entry: 1}
        order = self._topological_order()
        for cname in order:
            if cname not in mult:
                continue
            base = mult[cname]
            for ins in self.computations[cname].instructions:
                factor: int | None = 1
                if ins.opcode == "while":
                    factor = ins.trip_count
                for callee in ins.called_computations:
                    if callee not in self.computations:
                        continue
                    m = None if base is None or factor is None else base * factor
                    if callee in mult:
                        old = mult[callee]
                        mult[callee] = None if old is None or m is None else max(old, m)
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

    def find(self, opcode: str | Iterable[str]) -> list[Instruction]:
        ops = {opcode} if isinstance(opcode, str) else set(opcode)
        return [i for i in self.instructions() if i.opcode in ops]

    # -- collectives -------------------------------------------------------------------

    def collectives(self) -> list[Collective]:
        done_of: dict[str, Instruction] = {}
        for ins in self.instructions():
            if ins.opcode.endswith("-done") or ins.opcode == "async-done":
                for o in ins.operands:
                    done_of[o] = ins
        out = []
        for ins in self.instructions():
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
                    num_devices=self.num_partitions * self.replica_count,
                )
            out.append(
                Collective(
                    kind=kind,
                    instruction=ins,
                    computation=ins.computation,
                    in_loop=self.in_loop(ins),
                    replica_groups=groups,
                    source_target_pairs=pairs,
                    bytes=nbytes,
                    trip_multiplier=self.trip_multiplier(ins.computation),
                )
            )
        return out

    def count_collectives(self, kinds: Sequence[str] = COLLECTIVE_KINDS) -> dict[str, dict]:
        return count_collectives(self, kinds)


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


# ----------------------------------------------------------------------------- parsing

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^\s*([A-Za-z][\w\-]*)\(")


def parse_hlo(text: str) -> HloModule:
    """Parse HLO text (as printed by `compiled.as_text()`) into an HloModule."""
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
                parts = _split_top(line[len("HloModule") :].strip())
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
        end = _match_close(rest, 0)
        type_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    mo = _OPCODE.match(rest)
    if not mo:
        return None
    opcode = mo.group(1)
    open_idx = rest.index("(", mo.start(1))
    close_idx = _match_close(rest, open_idx)
    operand_text = rest[open_idx + 1 : close_idx]
    attr_text = rest[close_idx + 1 :].lstrip().lstrip(",")
    attrs = _parse_attrs(attr_text)
    operands = tuple(_operand_names(operand_text))
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


def _operand_names(text: str) -> list[str]:
    if "%" in text:
        return re.findall(r"%([^\s,(){}]+)", text)
    names = []
    for part in _split_top(text):
        tok = part.strip().split(" ")[-1] if part.strip() else ""
        if tok and re.match(r"^[A-Za-z_][\w.\-]*$", tok):
            names.append(tok)
    return names


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    parts = _split_top(text)
    last_key = None
    for part in parts:
        part = part.strip()
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip()
        if (
            eq
            and key == "device_ids"
            and last_key is not None
            and attrs[last_key].startswith("mesh[")
        ):
            # `replica_groups=mesh[...], device_ids=(...) {axes}` prints a top-level comma.
            attrs[last_key] += ", " + part
            continue
        if not eq:
            if last_key is not None:
                attrs[last_key] += ", " + part
            continue
        attrs[key] = value.strip()
        last_key = key
    return attrs


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets and quotes."""
    out, buf, depth, quote = [], [], 0, None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(text):
                buf.append(text[i + 1])
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            buf.append(ch)
        elif ch in "([{":
            depth += 1
            buf.append(ch)
        elif ch in ")]}":
            depth -= 1
            buf.append(ch)
        elif ch == "," and depth == 0:
            out.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        i += 1
    if buf:
        out.append("".join(buf))
    return out


def _match_close(text: str, open_idx: int) -> int:
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth, quote = 0, None
    for i in range(open_idx, len(text)):
        ch = text[i]
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
            continue
        if ch in "\"'" and depth > 0:
            quote = ch
        elif ch in pairs:
            depth += 1
        elif ch in pairs.values():
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO text: {text[:200]!r}")


def _names_in(value: str, *, bare_ok: bool) -> list[str]:
    names = re.findall(r"%([^\s,(){}]+)", value)
    if names or not bare_ok:
        return names
    return [n for n in re.findall(r"[A-Za-z_][\w.\-]*", value)]


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value)
    return value


# ----------------------------------------------------------------------------- replica groups


def parse_source_target_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """`{{0,1},{1,2}}` -> ((0, 1), (1, 2))."""
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text)
    return tuple((int(a), int(b)) for a, b in pairs)


def parse_replica_groups(text: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Decode a printed replica-group list into explicit groups of device (partition) ids.

    Forms: `{{0,1},{2,3}}`; `{}` (one group of all `num_devices`); `[G,S]<=[dims]` and
    `[G,S]<=[dims]T(perm)`; `mesh[a=2,b=4], device_ids=(...) {axes}` (quotes optional, sub-axes
    `b:(1)2`, `device_ids` either `[dims]T(perm)` or an explicit id list).
    """
    text = text.strip()
    if text.startswith("mesh[") or text.startswith("maximal_mesh["):
        return _mesh_groups(text)
    m = re.match(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$", text)
    if m:
        gdims = _ints(m.group(1))
        rdims = _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(rdims)))
        flat = _iota_transposed(rdims, perm)
        size = gdims[-1] if len(gdims) > 1 else len(flat)
        return tuple(tuple(flat[i : i + size]) for i in range(0, len(flat), size))
    if text.startswith("{"):
        groups = tuple(
            tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]) if g.strip()
        )
        if groups:
            return groups
        if num_devices is None:
            raise ValueError("replica_groups={} (all devices) needs num_devices")
        return (tuple(range(num_devices)),)
    raise ValueError(f"unrecognised replica_groups format: {text!r}")


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota_transposed(dims: Sequence[int], perm: Sequence[int]) -> list[int]:
    """Flattened iota(prod(dims)).reshape(dims).transpose(perm), row-major."""
    dims = list(dims)
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    out_dims = [dims[p] for p in perm]
    out = []
    for idx in itertools.product(*(range(d) for d in out_dims)):
        out.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
    return out


def _device_ids(text: str) -> list[int]:
    """`[2,4]T(1,0)`, `[8]`, `devices=[4,2]<=[2,4]T(1,0)`, `devices=[2,4]0,4,1,...` or `0,4,...`."""
    m = re.match(r"^(?:devices=)?\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$", text)
    if m:
        rdims = _ints(m.group(2))
        return _iota_transposed(rdims, _ints(m.group(3)) if m.group(3) else range(len(rdims)))
    m = re.match(r"^(?:devices=)?\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$", text)
    if m:
        rdims = _ints(m.group(1))
        return _iota_transposed(rdims, _ints(m.group(2)) if m.group(2) else range(len(rdims)))
    m = re.match(r"^(?:devices=)?\[[\d,\s]+\](.*)$", text)
    return _ints(m.group(1) if m else text)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    m = re.match(r"^maximal_mesh\[device_id=(\d+)\]", text)
    if m:
        return ((int(m.group(1)),),)
    close = _match_close(text, text.index("["))
    axes_text = text[text.index("[") + 1 : close]
    names, sizes = [], []
    for part in _split_top(axes_text):
        k, _, v = part.partition("=")
        names.append(k.strip().strip("'\""))
        sizes.append(int(v))
    rest = text[close + 1 :].strip().lstrip(",").strip()
    total = math.prod(sizes)
    devices = list(range(total))
    if rest.startswith("device_ids="):
        po = rest.index("(")
        pc = _match_close(rest, po)
        dev_text = rest[po + 1 : pc].strip()
        rest = rest[pc + 1 :].strip()
        devices = _device_ids(dev_text)
    if len(devices) != total:
        raise ValueError(f"mesh replica groups: {len(devices)} device ids for mesh {sizes}")
    ab = rest.find("{")
    refs_text = rest[ab + 1 : _match_close(rest, ab)] if ab >= 0 else ""
    refs: list[tuple[int, int, int]] = []  # (mesh dim, pre_size, size)
    for ref in _split_top(refs_text):
        ref = ref.strip()
        if not ref:
            continue
        mr = re.match(r"^['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?$", ref)
        if not mr:
            raise ValueError(f"mesh replica groups: bad axis reference {ref!r} in {text!r}")
        dim = names.index(mr.group(1)) if mr.group(1) in names else int(mr.group(1))
        if mr.group(2):
            refs.append((dim, int(mr.group(2)), int(mr.group(3))))
        else:
            refs.append((dim, 1, sizes[dim]))
    # Split every mesh dim into the pieces its references cut it into (major to minor), then
    # group over the referenced pieces in the order the references are listed.
    split_sizes: list[int] = []
    piece_of_ref: dict[int, int] = {}
    for dim, size in enumerate(sizes):
        dim_refs = sorted((r[1], i, r[2]) for i, r in enumerate(refs) if r[0] == dim)
        prefix = 1
        for pre, ref_idx, rsize in dim_refs:
            if pre != prefix:
                split_sizes.append(pre // prefix)
                prefix = pre
            piece_of_ref[ref_idx] = len(split_sizes)
            split_sizes.append(rsize)
            prefix *= rsize
        if prefix != size:
            split_sizes.append(size // prefix)
    grouped = [piece_of_ref[i] for i in range(len(refs))]
    others = [d for d in range(len(split_sizes)) if d not in grouped]
    strides = [1] * len(split_sizes)
    for i in range(len(split_sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * split_sizes[i + 1]
    groups = []
    for outer in itertools.product(*(range(split_sizes[d]) for d in others)):
        base = sum(o * strides[d] for o, d in zip(outer, others, strict=True))
        group = []
        for inner in itertools.product(*(range(split_sizes[d]) for d in grouped)):
            pos = base + sum(i * strides[d] for i, d in zip(inner, grouped, strict=True))
            group.append(devices[pos])
        groups.append(tuple(group))
    return tuple(groups)


def group_axes(
    groups: Sequence[Sequence[int]] | None, axis_sizes: Mapping[str, int] | Sequence[tuple]
) -> tuple[str, ...] | None:
    """Mesh axes a replica grouping spans, given the mesh's ordered {axis: size}.

    Device (partition) id p has mesh coordinates `unravel(p, sizes)` (row-major, the order of
    `mesh.devices.flat`). Returns the axes along which group members differ, in mesh order, if
    the groups are exactly "all devices that agree on every other axis"; () for trivial groups
    of one device; None if the groups are no such product (e.g. a strided sub-axis grouping).
    """
    if groups is None:
        return None
    items = list(axis_sizes.items()) if isinstance(axis_sizes, Mapping) else list(axis_sizes)
    names = [n for n, _ in items]
    sizes = [int(s) for _, s in items]
    total = math.prod(sizes)

    def coords(p: int) -> tuple[int, ...]:
        out = []
        for s in reversed(sizes):
            out.append(p % s)
            p //= s
        return tuple(reversed(out))

    varying: set[int] = set()
    for g in groups:
        cs = [coords(p) for p in g]
        for d in range(len(sizes)):
            if len({c[d] for c in cs}) > 1:
                varying.add(d)
    axes = tuple(names[d] for d in sorted(varying))
    expected_size = math.prod(sizes[d] for d in varying)
    seen = set()
    for g in groups:
        if len(g) != expected_size or len(set(g)) != len(g):
            return None
        cs = [coords(p) for p in g]
        fixed = {tuple(c[d] for d in range(len(sizes)) if d not in varying) for c in cs}
        if len(fixed) != 1:
            return None
        seen.update(g)
    if len(seen) != total:
        return None
    return axes


# ----------------------------------------------------------------------------- helpers


def _as_module(hlo: str | HloModule) -> HloModule:
    return hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)


def collectives(hlo: str | HloModule) -> list[Collective]:
    """Every collective of a compiled module (HLO text or HloModule); async pairs once."""
    return _as_module(hlo).collectives()


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
    for c in _as_module(hlo).collectives():
        if c.kind not in out["total"]:
            continue
        where = "inside_loops" if c.in_loop else "outside_loops"
        out[where][c.kind] += 1
        out["bytes_" + where][c.kind] += c.bytes
        out["total"][c.kind] += 1
    return out
