"""`trainer.accum_steps = "auto"`: the smallest k whose compiled step fits the device budget.

Candidates are the k that keep the batch (per node in a dry-run, global in training) divisible
by k x the batch shards of the mesh (data x fsdp). Per-device memory of the train step is
non-increasing in k (a minibatch's activations shrink, parameters and optimizer state stay), so
a binary search over the sorted candidates finds the smallest k that fits the budget after
about log2(#candidates) + 1 compiles:

    lo, hi = 0, n                       # invariant: candidates[:lo] do not fit, [hi:] fit
    while lo < hi: mid = (lo + hi) // 2; fits(mid) ? hi = mid : lo = mid + 1

A "measure" maps k to bytes per device; this module compiles nothing, so the search is tested
with injected measures. The measure the trainer and the dry-run use compiles the real
train step: `trn_accum.plan.autok.CompiledMemory`. `extrapolate` is the straight line through
two reduced depths it uses when a full-depth compile is slow:

    bytes(L) = bytes(L2) + (bytes(L2) - bytes(L1)) / (L2 - L1) * (L - L2)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trn_accum.core.batch_rules import valid_steps
from trn_accum.errors import UserError

GIB = 1024**3

__all__ = [
    "AutotuneError",
    "AutotuneResult",
    "autotune",
    "candidate_steps",
    "extrapolate",
    "format_bytes",
]


class AutotuneError(UserError):
    """No candidate fits, or the backend cannot report compiled memory: one line."""


# ---------------------------------------------------------------------------------------------
# Pure pieces


def candidate_steps(batch_rows: int, batch_shards: int) -> tuple[int, ...]:
    """Every k >= 1 with `batch_rows` divisible by k x `batch_shards`, ascending
    (`trn_accum.core.batch_rules.valid_steps`); AutotuneError when there is none."""
    if batch_rows < 1 or batch_shards < 1 or batch_rows % batch_shards:
        raise AutotuneError(
            f"batch of {batch_rows} rows is not divisible by the {batch_shards} batch shards "
            f"(data x fsdp) of the mesh: no accum_steps works; change data.global_batch or the mesh"
        )
    return valid_steps(batch_rows, batch_shards)


def extrapolate(depth_bytes: Mapping[int, int], layers: int) -> int:
    """Linear fit through the two measured depths {L1: b1, L2: b2}, evaluated at `layers`."""
    if len(depth_bytes) != 2:
        raise ValueError(f"extrapolate needs two depths, got {dict(depth_bytes)}")
    (l1, b1), (l2, b2) = sorted(depth_bytes.items())
    if l1 == l2:
        raise ValueError(f"extrapolate needs two different depths, got {dict(depth_bytes)}")
    return int(math.ceil(b2 + (b2 - b1) / (l2 - l1) * (layers - l2)))


@dataclasses.dataclass(frozen=True)
class AutotuneResult:
    """The choice and what was measured.

    accum_steps: the chosen k. table: {k: bytes per device} for every compiled (or extrapolated)
    k, ascending. candidates: every valid k. budget_bytes: the per-device budget. method: how
    bytes were obtained (e.g. "compiled at full depth (2 layers)"). details: {k: {...}} from the
    measure (depths compiled, compile seconds), when it records them.
    """

    accum_steps: int
    table: Mapping[int, int]
    candidates: tuple[int, ...]
    budget_bytes: int
    method: str = "injected measure"
    details: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    context: str = ""

    def format(self) -> str:
        """The table k -> bytes, one line per candidate, and the choice."""
        head = f'accum_steps = "auto": budget {format_bytes(self.budget_bytes)} per device'
        if self.context:
            head += f"; {self.context}"
        lines = [
            head,
            f"  candidates {', '.join(map(str, self.candidates))}; bytes = {self.method}",
            f"  {'k':>4}  {'bytes per device':>18}  fits",
        ]
        for k in self.candidates:
            if k in self.table:
                b = self.table[k]
                fits = "yes" if b <= self.budget_bytes else "no"
                lines.append(f"  {k:>4}  {format_bytes(b):>18}  {fits}")
            else:
                lines.append(f"  {k:>4}  {'(not compiled)':>18}")
        lines.append(
            f"  chose accum_steps = {self.accum_steps} (smallest that fits; "
            f"{len(self.table)} of {len(self.candidates)} candidates compiled)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "accum_steps": self.accum_steps,
            "budget_bytes": self.budget_bytes,
            "candidates": list(self.candidates),
            "table": {str(k): v for k, v in self.table.items()},
            "method": self.method,
            "details": {str(k): dict(v) for k, v in self.details.items()},
        }


def autotune(
    candidates: Sequence[int],
    measure: Callable[[int], int],
    budget_bytes: float,
    *,
    context: str = "",
) -> AutotuneResult:
    """Binary search for the smallest candidate k with `measure(k) <= budget_bytes`.

    Assumes `measure` is non-increasing in k. Measures about log2(len(candidates)) + 1 of
    them; the candidate just below the chosen one is always among them (it does not fit).
    Raises AutotuneError if even the largest candidate does not fit.
    """
    cands = tuple(sorted(set(int(k) for k in candidates)))
    if not cands or cands[0] < 1:
        raise AutotuneError(f"no valid accum_steps candidates: {list(candidates)}")
    table: dict[int, int] = {}

    def fits(i: int) -> bool:
        k = cands[i]
        if k not in table:
            table[k] = int(measure(k))
        return table[k] <= budget_bytes

    lo, hi = 0, len(cands)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    method = getattr(measure, "method", "injected measure")
    details = dict(getattr(measure, "details", {}) or {})
    ordered = dict(sorted(table.items()))
    if lo == len(cands):
        k_max = cands[-1]
        raise AutotuneError(
            f"accum_steps = auto: even the largest candidate k={k_max} needs "
            f"{format_bytes(table[k_max])} per device, over the budget of "
            f"{format_bytes(budget_bytes)} ({method}: "
            + ", ".join(f"k={k}: {format_bytes(b)}" for k, b in ordered.items())
            + "); raise trainer.memory_budget_gib, shorten data.seq_len, enable model.remat, "
            "or use more devices"
        )
    return AutotuneResult(
        accum_steps=cands[lo],
        table=ordered,
        candidates=cands,
        budget_bytes=int(budget_bytes),
        method=method,
        details={k: details[k] for k in ordered if k in details},
        context=context,
    )


def format_bytes(x: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= 0.1 * scale:
            return f"{x / scale:.2f} {unit}"
    return f"{int(x)} B"
