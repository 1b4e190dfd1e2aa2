"""Candidate configurations of a train step and the one the step-time model recommends.

A candidate is (mesh, nodes, k, reduce, remat, gather, attention_block): mesh one of `MESHES`
(per-axis sizes, -1 = all devices left), nodes the node count, k = trainer.accum_steps, reduce =
trainer.reduce, remat = model.remat, gather = trainer.gather, attention_block =
model.attention_block (None: the config's; the other values are tried on the fastest candidate
only). The grid (`candidate_grid`) takes, per (mesh, nodes), the k that fit the memory budget
(the analytic `trn_accum.analysis.memory.fit_by_steps`, smallest first; at most `k_limit` of
them: each k is its own program, priced by its own counters, and a larger k adds
per-minibatch parameter traffic and shrinks each minibatch's matmuls) and both reduce modes.
Nothing is compiled here: each candidate's `stepsummary.summarize` output comes from the
caller (`trn_accum.plan.perfmodel` compiles them).

`recommend` picks, among the candidates that fit at the chosen node count, the lowest
predicted step time (`predicted_step_s`; ties: the no-overlap floor), then trades up to
`HEADROOM_BAND` of that time for memory: of the candidates within the band, the one with the
fewest peak bytes per device wins (ties, or bytes not known: the larger k, then the faster).
Two reasons. No fit check on CPU is the target's allocator (the 3B dry-run's CPU-compiled
temporaries are 3.5x its analytic activations at k=4; on a TPU v5e the estimate said "fits"
for two 6-layer steps its compiler refused, docs/dry-run.md), and a run that does not fit
fails only after its long compile. And times within the band are not told apart by the model:
its held-out TPU v5e rows are off by up to 12.9 % (median 3.1 %, docs/calibration.md).
It says why in terms of the candidates it beats that differ in one choice (bytes over EFA /
NeuronLink, step time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from trn_accum.analysis.memory import format_bytes
from trn_accum.neuron import platform

__all__ = ["MESHES", "REDUCES", "Candidate", "candidate_grid", "format_rows", "recommend"]

#: The trn2 meshes compared: hybrid (nodes replicate over "data", FSDP over the rest of a
#: node) with tensor parallelism over the 4, 2 or 1 devices of a chip's share (model axis), and
#: the reference one (FSDP over every node, AXLearn's trn2 mesh).
MESHES = {
    "hybrid": {"data": -1, "fsdp": 16, "model": 4},
    "hybrid-m2": {"data": -1, "fsdp": 32, "model": 2},
    "hybrid-m1": {"data": -1, "fsdp": 64, "model": 1},
    "reference": {"data": 1, "fsdp": -1, "model": 4},
}
REDUCES = ("per_minibatch", "once")
#: Predicted step time given up for memory headroom (more minibatches, fewer live activations).
HEADROOM_BAND = 0.05


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    mesh: str
    nodes: int
    k: int
    reduce: str
    remat: str | None = None  # model.remat; None: the config's policy
    gather: str | None = None  # trainer.gather; None: the config's
    attention_block: int | None = None  # model.attention_block; None: the config's
    attention: str | None = None  # model.attention; None: the config's
    loss_chunk: int | None = None  # model.loss_chunk (0: the whole minibatch); None: the config's

    def label(self) -> str:
        named = [f" {k}={v}" for k, v in self.choices().items() if v is not None]
        return f"{self.mesh} x{self.nodes} k={self.k} {self.reduce}{''.join(named)}"

    def choices(self) -> dict:
        """The model and trainer settings it names beyond mesh, k and reduce (None: the
        config's), as `trn_accum.plan.perfmodel.with_choices` takes them."""
        return {
            "remat": self.remat,
            "gather": self.gather,
            "attention": self.attention,
            "attention_block": self.attention_block,
            "loss_chunk": self.loss_chunk,
        }


def candidate_grid(
    fitting_k: Mapping[tuple[str, int], Sequence[int]],
    *,
    reduces: Sequence[str] = REDUCES,
    k_limit: int = 3,
) -> list[Candidate]:
    """Candidates for every (mesh, nodes) -> the ks that fit (ascending): the `k_limit`
    smallest of them, each reduce mode."""
    out = []
    for (mesh, nodes), ks in sorted(fitting_k.items()):
        out += [Candidate(mesh, nodes, k, r) for k in sorted(ks)[:k_limit] for r in reduces]
    return out


def sort_key(row: Mapping[str, Any]) -> tuple[float, float]:
    """(predicted, no-overlap floor) step time of a row: the ranking (a summary without a
    prediction ranks by its floors)."""
    s = row["summary"]
    return (s.get("predicted_step_s", s["step_s_no_overlap"]), s["step_s_no_overlap"])


def _differs_in_one(a: Candidate, b: Candidate) -> str | None:
    names = [f.name for f in dataclasses.fields(Candidate)]
    diff = [n for n in names if getattr(a, n) != getattr(b, n)]
    return diff[0] if len(diff) == 1 else None


def _link_bytes(row, link: str) -> float:
    return row["summary"]["by_link"].get(link, {}).get("wire_bytes", 0.0)


def _headroom_key(row) -> tuple:
    """Order within the band: fewest peak bytes per device (unknown last), larger k, faster."""
    mem = row["summary"].get("memory_bytes")
    return (math.inf if mem is None else mem, -row["candidate"].k, sort_key(row))


def _headroom_reason(best, fastest) -> str:
    b, f = best["candidate"], fastest["candidate"]
    field = _differs_in_one(b, f)
    if field:
        what = f"{field} = {getattr(b, field)} over {getattr(f, field)}"
    else:
        what = f"{b.label()} over {f.label()}"
    text = (
        f"{what} for memory headroom: step {sort_key(best)[0]:.3f} s vs "
        f"{sort_key(fastest)[0]:.3f} s (predicted), within "
        f"{HEADROOM_BAND:.0%}; no CPU fit check is the target's allocator"
    )
    mb, mf = best["summary"].get("memory_bytes"), fastest["summary"].get("memory_bytes")
    if mb is not None and mf is not None:
        text += f"; {format_bytes(mb)} vs {format_bytes(mf)} per device"
    return text


def recommend(rows: Sequence[Mapping[str, Any]], nodes: int) -> dict[str, Any] | None:
    """rows: [{"candidate": Candidate, "fits": bool, "summary": steptime summary}]. The best
    fitting candidate at `nodes` nodes and the reason; None if none fits there."""
    pool = [r for r in rows if r["fits"] and r["candidate"].nodes == nodes]
    if not pool:
        return None
    pool.sort(key=sort_key)
    fastest = pool[0]
    limit = sort_key(fastest)[0] * (1 + HEADROOM_BAND)
    best = min((r for r in pool if sort_key(r)[0] <= limit), key=_headroom_key)
    b, bs = best["candidate"], best["summary"]
    reasons = [] if best is fastest else [_headroom_reason(best, fastest)]
    pool = [r for r in pool if r is not best]
    pool.insert(0, best)
    said: set[str] = set()
    for other in pool[1:]:
        field = _differs_in_one(b, other["candidate"])
        if field is None or field in said or other is fastest:
            continue  # (the fastest, when not chosen, is the headroom reason above)
        said.add(field)
        theirs = getattr(other["candidate"], field)
        theirs = "the config's" if theirs is None else theirs  # None: the config's setting
        parts = [
            f"{field} = {getattr(b, field)} over {theirs}: step "
            f"{sort_key(best)[0]:.3f} s vs {sort_key(other)[0]:.3f} s (predicted)"
        ]
        for link in (platform.LINK_EFA, platform.LINK_NODE):
            d = _link_bytes(other, link) - _link_bytes(best, link)
            if abs(d) >= 1:
                word = "less" if d > 0 else "more"
                parts.append(f"{format_bytes(abs(d))} {word} over {link} per device per step")
        reasons.append("; ".join(parts))
    bound = "communication" if bs["comm_s"] > bs["compute_s"] else "compute"
    reasons.append(
        f"{bound}-bound: compute {bs['compute_s']:.3f} s at peak, communication "
        f"{bs['comm_s']:.3f} s; MFU {bs['mfu'][0]:.1%}-{bs['mfu'][1]:.1%}"
    )
    return {"candidate": dataclasses.asdict(b), "label": b.label(), "reasons": reasons}


def format_rows(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per candidate: fit, bytes per link, compute, comm, step bounds, tokens/s, MFU."""
    w = max([33, *(len(r["candidate"].label()) for r in rows)])
    head = (
        f"  {'candidate':<{w}} {'fits':>4} {'chip':>10} {'node':>10} {'efa':>10} {'compute':>8} "
        f"{'comm':>8} {'step s':>15} {'tokens/s':>19} {'MFU':>13}"
    )
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["candidate"].nodes, sort_key(r))):
        s = r["summary"]
        cells = [format_bytes(_link_bytes(r, lk)) for lk in platform.LINK_CLASSES]
        lo, hi = s["step_s_full_overlap"], s["step_s_no_overlap"]
        lines.append(
            f"  {r['candidate'].label():<{w}} {'yes' if r['fits'] else 'no':>4} "
            f"{cells[0]:>10} {cells[1]:>10} {cells[2]:>10} {s['compute_s']:>8.3f} "
            f"{s['comm_s']:>8.3f} {lo:>7.3f}-{hi:<7.3f} "
            f"{s['tokens_per_s'][0]:>9.3g}-{s['tokens_per_s'][1]:<9.3g} "
            f"{s['mfu'][0]:>6.1%}-{s['mfu'][1]:<6.1%}"
        )
    return lines
