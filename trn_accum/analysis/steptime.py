"""Step time on paper, from a compiled program: every collective's bytes, link and ring time.

Input: the compiled (partitioned) HLO of one train step, the mesh it was compiled on
(`compiled_shape`, ordered {axis: size}) and the mesh it stands for (`target_shape`: the same
axes, the real sizes, e.g. data 32 where the compile had data 2), plus a `Layout` saying how
mesh positions sit on hardware (positions in `mesh.devices.flat` order; node = p //
devices_per_node, chip = p // devices_per_chip: jax.make_mesh lays devices out row-major, so
the trailing axes stay inside a chip, then a node).

Per collective (`collective_costs`): kind, the mesh axes its groups span (`group_axes`), its
trip count (product of the enclosing loops' known trip counts, `HloModule.trip_multiplier`),
the group size on the target mesh, how a group splits over the levels of the hardware
(`group_levels`: devices per chip, chips per node, nodes) and:

    S = the full buffer of one group, at the partitioner's dtype (`Collective.wire_bytes_source`:
        XLA:CPU's float32 widening of bf16 collectives undone): all-gather result;
        reduce-scatter result x n_compiled; all-reduce / all-to-all / collective-permute result
    hierarchical algorithms (the levels innermost first, n_l the group's extent at level l,
        S_l = S / (product of the n of the levels inside l)); per device per run:
        all-reduce: reduce-scatter up the levels, all-reduce of the node's share across nodes,
            all-gather down: wire_l = 2 (n_l - 1) / n_l x S_l, steps_l = 2 (n_l - 1)
        all-gather, reduce-scatter: wire_l = (n_l - 1) / n_l x S_l, steps_l = n_l - 1
        all-to-all, collective-permute: one ring on the slowest link (S x (n - 1) / n; S)
    time per run = sum over levels of wire_l / bandwidth_l + steps_l x latency_l + fixed_l (levels
        one after the other; bandwidth, latency and fixed cost of the link class: the peak links
        of `trn_accum.neuron.platform` for the floor, fixed 0; the achieved ones of
        `trn_accum.analysis.platforms` for the prediction)

A group on one level is the flat ring. A group over data x fsdp (16 devices per node, one per
chip, 32 nodes) crosses EFA with 1/16 of the buffer in 2 x 31 steps, not as a 512-device ring
on EFA. That the runtime runs such groups hierarchically is this model's assumption (the
common algorithm for multi-level fabrics); the Neuron runtime's inter-node collectives page
(neuron-runtime/explore/internode-collective-comm) gives ring step counts, not the split.

S does not depend on the size of the axes a collective runs over (all-gathers gather whole
parameters, reduce-scatters scatter them, all-reduces reduce a shard of another axis), which is
what lets a program compiled on 2 nodes stand for 32, as long as its loops' trip counts do not
depend on the node count either (the loss-chunk loop of `trn_accum.model.xent` is sized per
batch shard for this; `stepsummary.trip_counts` lists a program's loops to check it).
`trn_accum.analysis.stepsummary` adds the costs per link class and per axis set and turns them
into step-time bounds and the prediction.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from trn_accum.analysis.collectives import Collective, collectives, group_axes
from trn_accum.analysis.hlo.module import HloModule
from trn_accum.neuron import platform

__all__ = [
    "CollectiveCost",
    "Layout",
    "axis_groups",
    "collective_costs",
    "group_levels",
    "hierarchical_cost",
    "link_of_groups",
    "ring_wire_bytes",
    "ring_time",
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

    @classmethod
    def of(cls, plat, *, achieved: bool = False, devices_per_node: int | None = None) -> Layout:
        """The layout of a `trn_accum.analysis.platforms.Platform`: its peak links (the
        floor) or its achieved ones; `devices_per_node` overrides the platform's (a dry-run
        of fewer devices than a whole node)."""
        per_node = plat.devices_per_node if devices_per_node is None else devices_per_node
        links = plat.achieved_links if achieved else plat.links
        return cls(per_node, min(plat.devices_per_chip, per_node), links)


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
    fixed = link.get("fixed_s", 0.0)  # per run (achieved links: the collective's floor)
    wire = ring_wire_bytes(kind, full_bytes, n)
    return wire / link["bytes_per_s"] + steps * link["latency_s"] + fixed


def group_levels(groups: Sequence[Sequence[int]], layout: Layout) -> tuple[int, int, int] | None:
    """(devices per chip, chips per node, nodes) that every group of >= 2 devices spans, in
    the order of `platform.LINK_CLASSES`; None when the groups are not regular (different
    counts per chip or node) or when every group is a single device."""
    levels = None
    for g in groups:
        if len(g) < 2:
            continue
        chips: dict[int, int] = {}
        for p in g:
            chips[p // layout.devices_per_chip] = chips.get(p // layout.devices_per_chip, 0) + 1
        nodes: dict[int, int] = {}
        for c in chips:
            n = c * layout.devices_per_chip // layout.devices_per_node
            nodes[n] = nodes.get(n, 0) + 1
        if len(set(chips.values())) != 1 or len(set(nodes.values())) != 1:
            return None
        here = (next(iter(chips.values())), next(iter(nodes.values())), len(nodes))
        if levels not in (None, here):
            return None
        levels = here
    return levels


def hierarchical_cost(
    kind: str, full_bytes: float, levels: Sequence[int], links: Mapping[str, Mapping[str, float]]
) -> dict[str, tuple[float, float]]:
    """{link class: (wire bytes, seconds)} per device per run of a collective whose groups span
    `levels` = (n_chip, n_node, n_efa) (see the module docstring); levels of extent 1 move
    nothing. all-to-all and collective-permute: one ring on the outermost level used."""
    out: dict[str, tuple[float, float]] = {}
    if kind in ("all-reduce", "all-gather", "reduce-scatter"):
        share = float(full_bytes)
        for link, n in zip(platform.LINK_CLASSES, levels, strict=True):
            if n > 1:
                wire = ring_wire_bytes(kind, share, n)
                out[link] = (wire, ring_time(kind, share, n, links.get(link)))
            share /= n
        return out
    n = math.prod(levels)
    outer = [lk for lk, m in zip(platform.LINK_CLASSES, levels, strict=True) if m > 1]
    if outer:
        out[outer[-1]] = (
            ring_wire_bytes(kind, full_bytes, n),
            ring_time(kind, full_bytes, n, links.get(outer[-1])),
        )
    return out


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective on the target mesh. bytes: S (see the module docstring); wire_bytes and
    time_s per device per step (x trips), split per link class in `by_link` {link: (wire
    bytes, seconds)}; link: the slowest class it crosses; levels: (n_chip, n_node, n_efa) or
    None (irregular groups: one ring on the slowest link); trips: runs per step (1 if unknown,
    flagged)."""

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
    levels: tuple[int, int, int] | None = None
    by_link: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def _full_bytes(c: Collective, n_compiled: int) -> int:
    b = c.wire_bytes_source
    return b * n_compiled if c.kind == "reduce-scatter" else b


def _cost(
    c: Collective,
    compiled_shape: Mapping[str, int],
    target_shape: Mapping[str, int],
    layout: Layout,
    cache: dict,
) -> CollectiveCost:
    trips = c.trip_multiplier
    if c.kind == "collective-permute":
        groups = c.source_target_pairs or ()
        axes, n_c = None, 2 if groups else 1
    else:
        groups = c.replica_groups or ()
        axes = group_axes(groups, compiled_shape)
        n_c = max((len(g) for g in groups), default=1)
    if axes is not None:  # priced on the target mesh's groups of those axes
        n = math.prod(target_shape[a] for a in axes)
        if axes not in cache:
            tg = axis_groups(axes, target_shape)
            cache[axes] = (link_of_groups(tg, layout), group_levels(tg, layout))
        link, levels = cache[axes]
    else:  # not a product of mesh axes: the compiled groups as they are
        n, link, levels = n_c, link_of_groups(groups, layout), group_levels(groups, layout)
    full = _full_bytes(c, n_c)
    runs = 1 if trips is None else trips
    if c.kind == "collective-permute" or levels is None:
        lk = layout.links.get(link) if link else None
        one = {link: (ring_wire_bytes(c.kind, full, n), ring_time(c.kind, full, n, lk))}
        one = {} if link is None else one
    else:
        one = hierarchical_cost(c.kind, full, levels, layout.links)
    by_link = {lk: (w * runs, t * runs) for lk, (w, t) in one.items()}
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
        wire_bytes=sum(w for w, _ in by_link.values()),
        time_s=sum(t for _, t in by_link.values()),
        levels=levels,
        by_link=by_link,
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
