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
import itertools
import math
import re
from collections.abc import Mapping, Sequence

from trn_accum.analysis.hlo import HloModule, Instruction, parse_hlo
from trn_accum.analysis.hlo_text import match_close, split_top_level

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
    close = match_close(text, text.index("["))
    axes_text = text[text.index("[") + 1 : close]
    names, sizes = [], []
    for part in split_top_level(axes_text):
        k, _, v = part.partition("=")
        names.append(k.strip().strip("'\""))
        sizes.append(int(v))
    rest = text[close + 1 :].strip().lstrip(",").strip()
    total = math.prod(sizes)
    devices = list(range(total))
    if rest.startswith("device_ids="):
        po = rest.index("(")
        pc = match_close(rest, po)
        dev_text = rest[po + 1 : pc].strip()
        rest = rest[pc + 1 :].strip()
        devices = _device_ids(dev_text)
    if len(devices) != total:
        raise ValueError(f"mesh replica groups: {len(devices)} device ids for mesh {sizes}")
    ab = rest.find("{")
    refs_text = rest[ab + 1 : match_close(rest, ab)] if ab >= 0 else ""
    refs: list[tuple[int, int, int]] = []  # (mesh dim, pre_size, size)
    for ref in split_top_level(refs_text):
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
