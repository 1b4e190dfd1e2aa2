"""Step time on paper, from a compiled program: every collective's bytes, link and ring time.

Input: the compiled (partitioned) HLO of one train step, the mesh it was compiled on
(`compiled_shape`, ordered {axis: size}) and the mesh it stands for (`target_shape`: the same
axes, the real sizes, e.g. data 32 where the compile had data 2), plus a `Layout` saying how
mesh positions sit on hardware (positions in `mesh.devices.flat` order; node = p //
devices_per_node, chip = p // devices_per_chip: jax.make_mesh lays devices out row-major, so
the trailing axes stay inside a chip, then a node).

Per collective (`collective_costs`): kind, the mesh axes its groups span (`group_axes`), its
trip count (product of the enclosing loops' known trip counts, `HloModule.trip_multiplier`),
the group size on the target mesh, the slowest link class a group crosses there, and:

    S = the full buffer of one group: all-gather result; reduce-scatter result x n_compiled;
        all-reduce / all-to-all / collective-permute result
    wire bytes per device per run (ring algorithm, n = group size on the target mesh):
        all-gather, reduce-scatter, all-to-all: (n - 1) / n x S
        all-reduce (reduce-scatter + all-gather):  2 (n - 1) / n x S
        collective-permute: S
    time per run = wire / bandwidth + steps x latency, steps = n - 1 (2 (n - 1) all-reduce, 1
        permute), bandwidth and latency of the link class (`trn_accum.neuron.platform`)

S does not depend on the size of the axes a collective runs over (all-gathers gather whole
parameters, reduce-scatters scatter them, all-reduces reduce a shard of another axis), which is
what lets a program compiled on 2 nodes stand for 32. `summarize` adds them per link class
and per axis set, and turns them into step-time bounds: no overlap (compute + communication)
and full overlap (max of the two), with tokens/s and MFU at each.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from trn_accum.analysis.autotune import extrapolate
from trn_accum.analysis.collectives import Collective, collectives, group_axes
from trn_accum.analysis.hlo import HloModule
from trn_accum.neuron import platform

__all__ = [
    "CollectiveCost",
    "Layout",
    "axis_groups",
    "collective_costs",
    "extrapolate_summary",
    "link_of_groups",
    "ring_wire_bytes",
    "ring_time",
    "summarize",
]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh position -> (node, chip): node = p // devices_per_node, chip = p // devices_per_chip.
    `links`: {link class: {"bytes_per_s", "latency_s"}} (default: trn2 at LNC=2)."""

    devices_per_node: int
    devices_per_chip: int
    links: Mapping[str, Mapping[str, float]] = dataclasses.field(
        default_factory=platform.trn2_links
    )

    @classmethod
    def trn2(cls, lnc: int = platform.DEFAULT_LNC) -> Layout:
        return cls(
            platform.devices_per_node(lnc), platform.devices_per_chip(lnc), platform.trn2_links(lnc)
        )


def link_of_groups(groups: Sequence[Sequence[int]], layout: Layout) -> str | None:
    """Slowest link class any group crosses (LINK_EFA > LINK_NODE > LINK_CHIP); None when every
    group is a single device (nothing moves)."""
    worst = -1
    for g in groups:
        if len(g) < 2:
            continue
        if len({p // layout.devices_per_node for p in g}) > 1:
            return platform.LINK_EFA
        worst = max(worst, 1 if len({p // layout.devices_per_chip for p in g}) > 1 else 0)
    return None if worst < 0 else platform.LINK_CLASSES[worst]


def axis_groups(axes: Sequence[str], shape: Mapping[str, int]) -> tuple[tuple[int, ...], ...]:
    """Groups of mesh positions (row-major over the ordered `shape`) that differ only along
    `axes`: one group per coordinate of the other axes."""
    names, sizes = list(shape), [int(s) for s in shape.values()]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    inner = [i for i, n in enumerate(names) if n in axes]
    outer = [i for i in range(len(names)) if i not in inner]
    groups = []
    for o in itertools.product(*(range(sizes[i]) for i in outer)):
        base = sum(c * strides[i] for c, i in zip(o, outer, strict=True))
        groups.append(
            tuple(
                base + sum(c * strides[i] for c, i in zip(x, inner, strict=True))
                for x in itertools.product(*(range(sizes[i]) for i in inner))
            )
        )
    return tuple(groups)


def ring_wire_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one device sends per run of a collective over `n` devices (ring algorithms)."""
    if n < 2:
        return 0.0
    if kind == "collective-permute":
        return float(full_bytes)
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * (n - 1) / n * full_bytes


def ring_time(kind: str, full_bytes: float, n: int, link: Mapping[str, float] | None) -> float:
    """Seconds per run: wire bytes / bandwidth + ring steps x latency (0 when nothing moves)."""
    if n < 2 or link is None:
        return 0.0
    steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)
    return ring_wire_bytes(kind, full_bytes, n) / link["bytes_per_s"] + steps * link["latency_s"]


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective on the target mesh. bytes: S (see the module docstring); wire_bytes and
    time_s per device per step (x trips); trips: runs per step (1 if unknown, flagged)."""

    name: str
    kind: str
    axes: tuple[str, ...] | None
    group_size: int
    link: str | None
    trips: int
    trips_known: bool
    in_loop: bool
    bytes: int
    wire_bytes: float
    time_s: float


def _full_bytes(c: Collective, n_compiled: int) -> int:
    return c.bytes * n_compiled if c.kind == "reduce-scatter" else c.bytes


def _cost(
    c: Collective,
    compiled_shape: Mapping[str, int],
    target_shape: Mapping[str, int],
    layout: Layout,
    link_cache: dict,
) -> CollectiveCost:
    trips = c.trip_multiplier
    if c.kind == "collective-permute":
        pairs = c.source_target_pairs or ()
        axes, n_c = None, 2 if pairs else 1
        n, link = n_c, link_of_groups(pairs, layout)
    else:
        groups = c.replica_groups or ()
        axes = group_axes(groups, compiled_shape)
        n_c = max((len(g) for g in groups), default=1)
        if axes is None:  # not a product of mesh axes: take the compiled groups as they are
            n, link = n_c, link_of_groups(groups, layout)
        else:
            n = math.prod(target_shape[a] for a in axes)
            if axes not in link_cache:
                link_cache[axes] = link_of_groups(axis_groups(axes, target_shape), layout)
            link = link_cache[axes]
    full = _full_bytes(c, n_c)
    runs = 1 if trips is None else trips
    lk = layout.links.get(link) if link else None
    return CollectiveCost(
        name=c.instruction.name,
        kind=c.kind,
        axes=axes,
        group_size=n,
        link=link,
        trips=runs,
        trips_known=trips is not None,
        in_loop=c.in_loop,
        bytes=full,
        wire_bytes=ring_wire_bytes(c.kind, full, n) * runs,
        time_s=ring_time(c.kind, full, n, lk) * runs,
    )


def collective_costs(
    hlo: str | HloModule,
    compiled_shape: Mapping[str, int],
    target_shape: Mapping[str, int] | None = None,
    layout: Layout | None = None,
) -> list[CollectiveCost]:
    """Every collective of the compiled step priced on the target mesh (default: the compiled
    one) and layout (default: trn2 at LNC=2). Shapes must name the same axes in the same
    order (the mesh's axis order)."""
    target = dict(compiled_shape if target_shape is None else target_shape)
    if list(target) != list(compiled_shape):
        raise ValueError(f"target mesh {target} must have the axes of {dict(compiled_shape)}")
    layout = Layout.trn2() if layout is None else layout
    cache: dict = {}
    return [_cost(c, compiled_shape, target, layout, cache) for c in collectives(hlo)]


def _axes_key(axes: tuple[str, ...] | None) -> str:
    return "?" if axes is None else "+".join(axes) or "-"


def summarize(
    costs: Sequence[CollectiveCost],
    *,
    flops_per_step: float,
    peak_flops: float,
    tokens_per_step: float,
    accum_steps: int = 1,
) -> dict[str, Any]:
    """Totals per step and bounds. flops_per_step: all devices (analytic); peak_flops: of all
    devices together; accum_steps: k, to report the loop's traffic per minibatch.

    Returns {"by_link": {link: {"wire_bytes", "time_s", "count"}}, "by_axes": {"fsdp": {...,
    "loop_wire_bytes_per_minibatch"}}, "comm_s", "compute_s", "step_s_no_overlap",
    "step_s_full_overlap", "tokens_per_s": [low, high], "mfu": [low, high],
    "unknown_trips"}; wire bytes and times are per device.
    """
    by_link = {lk: {"wire_bytes": 0.0, "time_s": 0.0, "count": 0} for lk in platform.LINK_CLASSES}
    by_axes: dict[str, dict[str, float]] = {}
    for c in costs:
        if c.link is not None:
            row = by_link.setdefault(c.link, {"wire_bytes": 0.0, "time_s": 0.0, "count": 0})
            row["wire_bytes"] += c.wire_bytes
            row["time_s"] += c.time_s
            row["count"] += 1
        a = by_axes.setdefault(
            _axes_key(c.axes),
            {"wire_bytes": 0.0, "time_s": 0.0, "loop_wire_bytes_per_minibatch": 0.0},
        )
        a["wire_bytes"] += c.wire_bytes
        a["time_s"] += c.time_s
        if c.in_loop:
            a["loop_wire_bytes_per_minibatch"] += c.wire_bytes / max(1, accum_steps)
    comm = sum(r["time_s"] for r in by_link.values())
    return _bounds(
        {
            "by_link": by_link,
            "by_axes": by_axes,
            "comm_s": comm,
            "unknown_trips": sum(not c.trips_known for c in costs),
        },
        flops_per_step,
        peak_flops,
        tokens_per_step,
    )


def _bounds(out: dict, flops: float, peak: float, tokens: float) -> dict:
    compute = flops / peak
    comm = out["comm_s"]
    slow, fast = compute + comm, max(compute, comm)
    return {
        **out,
        "compute_s": compute,
        "step_s_no_overlap": slow,
        "step_s_full_overlap": fast,
        "tokens_per_s": [tokens / slow, tokens / fast],
        "mfu": [compute / slow, compute / fast],
        "flops_per_step": flops,
        "peak_flops": peak,
        "tokens_per_step": tokens,
    }


def _extrapolate_rows(rows: Mapping[int, Mapping[str, Mapping[str, float]]], layers: int) -> dict:
    """{depth: {key: {field: value}}} -> {key: {field: value at `layers`}}; a key missing at
    one depth counts 0 there; seconds are fitted in nanoseconds (extrapolate rounds up)."""
    depths = sorted(rows)
    keys = sorted(set().union(*(rows[d] for d in depths)))
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        fields = sorted(set().union(*(rows[d].get(key, {}) for d in depths)))
        out[key] = {}
        for f in fields:
            scale = 1e9 if f.endswith("_s") else 1.0
            pts = {d: int(round(rows[d].get(key, {}).get(f, 0) * scale)) for d in depths}
            out[key][f] = max(0, extrapolate(pts, layers)) / scale
    return out


def extrapolate_summary(by_depth: Mapping[int, Mapping[str, Any]], layers: int) -> dict[str, Any]:
    """Summaries at two depths {L1: s1, L2: s2} -> the summary at `layers`: wire bytes, times
    and counts per link and per axis set extrapolated linearly per layer
    (`trn_accum.analysis.autotune.extrapolate`), FLOPs and tokens from the deeper one (they are
    analytic: pass them for the full depth), bounds recomputed."""
    if len(by_depth) != 2:
        raise ValueError(f"extrapolate_summary needs two depths, got {sorted(by_depth)}")
    deep = by_depth[max(by_depth)]
    rows = _extrapolate_rows({d: s["by_link"] for d, s in by_depth.items()}, layers)
    by_link = {lk: rows[lk] for lk in platform.LINK_CLASSES if lk in rows}
    out = {
        "by_link": by_link,
        "by_axes": _extrapolate_rows({d: s["by_axes"] for d, s in by_depth.items()}, layers),
        "comm_s": sum(r["time_s"] for r in by_link.values()),
        "unknown_trips": max(s["unknown_trips"] for s in by_depth.values()),
    }
    return _bounds(out, deep["flops_per_step"], deep["peak_flops"], deep["tokens_per_step"])
