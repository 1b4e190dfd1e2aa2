"""A step's summary from its priced collectives (and ops): totals per link class and per axis
set, the floor: no overlap (compute + communication) and full overlap (max of the two), compute
= the FLOPs the program executes (HLO dots x trips, remat included) at peak, MFU = useful
(analytic) FLOPs / (peak x step); the calibrated prediction; and the line through two compiled
depths that stands for the full depth. The collectives' prices come from
`trn_accum.analysis.steptime`, the ops' from `trn_accum.analysis.pricing`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trn_accum.analysis.hlo.module import HloModule
from trn_accum.analysis.memory import extrapolate
from trn_accum.neuron import platform

__all__ = ["bounds", "extrapolate_summary", "summarize", "trip_counts"]


def _axes_key(axes: tuple[str, ...] | None) -> str:
    return "?" if axes is None else "+".join(axes) or "-"


def summarize(
    costs: Sequence[Any],
    *,
    flops_per_step: float,
    peak_flops: float,
    tokens_per_step: float,
    accum_steps: int = 1,
    flops_executed_per_step: float | None = None,
    comm_predicted_s: float | None = None,
    ops: Mapping[str, float] | None = None,
    overlap: float = 0.0,
) -> dict[str, Any]:
    """Totals per step and bounds. flops_per_step: useful FLOPs of all devices (analytic);
    flops_executed_per_step: what the program executes on all devices (HLO dots x trips,
    remat recompute included; default: the useful ones); peak_flops: of all devices together;
    accum_steps: k, to report the loop's traffic per minibatch.

    Returns {"by_link": {link: {"wire_bytes", "time_s", "count"}}, "by_axes": {"fsdp": {...,
    "loop_wire_bytes_per_minibatch"}}, "comm_s", "compute_s" (executed FLOPs at peak),
    "step_s_no_overlap", "step_s_full_overlap", "tokens_per_s": [low, high], "mfu": [no
    overlap, full overlap] (useful FLOPs), "flops_per_step", "flops_executed_per_step",
    "peak_flops", "unknown_trips"}; wire bytes and times are per device. With `ops` (the
    priced ops of `trn_accum.analysis.pricing.price`, with their features) and
    `comm_predicted_s` (the collectives on the achieved links) also "ops", "comm_predicted_s",
    "overlap", "predicted_step_s" = ops + comm - overlap x min(ops, comm) (`overlap` the share of
    the shorter of the two hidden behind the other: 0 none, 1 full) and "predicted_mfu".
    """
    by_link = {lk: {"wire_bytes": 0.0, "time_s": 0.0, "count": 0} for lk in platform.LINK_CLASSES}
    by_axes: dict[str, dict[str, float]] = {}
    for c in costs:
        for link, (wire, secs) in c.by_link.items():
            row = by_link.setdefault(link, {"wire_bytes": 0.0, "time_s": 0.0, "count": 0})
            row["wire_bytes"] += wire
            row["time_s"] += secs
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
    executed = flops_per_step if flops_executed_per_step is None else flops_executed_per_step
    extra = {}
    if ops is not None:
        extra = {"ops": dict(ops), "comm_predicted_s": comm_predicted_s or 0.0, "overlap": overlap}
    return bounds(
        {
            "by_link": by_link,
            "by_axes": by_axes,
            "comm_s": comm,
            "unknown_trips": sum(not c.trips_known for c in costs),
            **extra,
        },
        flops_per_step,
        peak_flops,
        tokens_per_step,
        executed,
    )


def bounds(out: dict, flops: float, peak: float, tokens: float, executed: float | None = None):
    executed = flops if executed is None else executed
    compute = executed / peak
    comm = out["comm_s"]
    slow, fast = compute + comm, max(compute, comm)
    useful = flops / peak
    if "ops" in out:
        ops_s, comm_s = out["ops"]["total_s"], out["comm_predicted_s"]
        predicted = ops_s + comm_s - out.get("overlap", 0.0) * min(ops_s, comm_s)
        out = {**out, "predicted_step_s": predicted, "predicted_mfu": useful / predicted}
    return {
        **out,
        "compute_s": compute,
        "step_s_no_overlap": slow,
        "step_s_full_overlap": fast,
        "tokens_per_s": [tokens / slow, tokens / fast],
        "mfu": [useful / slow, useful / fast],
        "flops_per_step": flops,
        "flops_executed_per_step": executed,
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
    and counts per link and per axis set and the executed FLOPs extrapolated linearly per layer
    (`trn_accum.analysis.memory.extrapolate`), useful FLOPs and tokens from the deeper one
    (analytic: pass them for the full depth), bounds recomputed."""
    if len(by_depth) != 2:
        raise ValueError(f"extrapolate_summary needs two depths, got {sorted(by_depth)}")
    deep = by_depth[max(by_depth)]
    rows = _extrapolate_rows({d: s["by_link"] for d, s in by_depth.items()}, layers)
    by_link = {lk: rows[lk] for lk in platform.LINK_CLASSES if lk in rows}
    executed = extrapolate(
        {d: int(s["flops_executed_per_step"]) for d, s in by_depth.items()}, layers
    )
    out = {
        "by_link": by_link,
        "by_axes": _extrapolate_rows({d: s["by_axes"] for d, s in by_depth.items()}, layers),
        "comm_s": sum(r["time_s"] for r in by_link.values()),
        "unknown_trips": max(s["unknown_trips"] for s in by_depth.values()),
    }
    if all("ops" in s for s in by_depth.values()):
        rows = {
            d: {"ops": s["ops"], "comm": {"predicted_s": s["comm_predicted_s"]}}
            for d, s in by_depth.items()
        }
        line = _extrapolate_rows(rows, layers)
        out["ops"] = line["ops"]
        out["comm_predicted_s"] = line["comm"]["predicted_s"]
        out["overlap"] = deep.get("overlap", 0.0)
    return bounds(
        out, deep["flops_per_step"], deep["peak_flops"], deep["tokens_per_step"], executed
    )


def trip_counts(hlo: str | HloModule) -> list[int | None]:
    """The trip count of every `while` loop of a program (None: unknown), sorted: equal lists
    for the same program at two node counts are what lets one compile stand for another."""
    from trn_accum.analysis.hlo.module import parse_hlo

    module = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    trips = (w.trip_count or module.counted_trips(w) for w in module.while_loops())
    return sorted(trips, key=lambda t: (t is None, t or 0))
