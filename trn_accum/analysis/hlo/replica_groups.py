"""Replica groups as HLO prints them, decoded to device ids, and mapped back to mesh axes.

Forms (`parse_replica_groups`): explicit lists `{{0,1},{2,3}}` (`{}`: one group of every device);
iota lists `[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`; mesh-axes lists
`mesh['axis_0'=1,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}` with sub-axes `{'a':(1)2}`.
Device ids are partition ids: positions in `mesh.devices.flat`; `group_axes` names the mesh
axes a grouping spans.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence

from trn_accum.analysis.hlo.text import match_close, split_top_level


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
