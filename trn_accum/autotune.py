"""`trainer.accum_steps = "auto"`: the smallest k whose compiled step fits the device budget.

Candidates are the k that keep the batch (per node in a dry-run, global in training) divisible
by k x the batch shards of the mesh (data x fsdp). Per-device memory of the train step is
non-increasing in k (a minibatch's activations shrink, parameters and optimizer state stay), so
a binary search over the sorted candidates finds the smallest k that fits the budget after
about log2(#candidates) + 1 compiles:

    lo, hi = 0, n                       # invariant: candidates[:lo] do not fit, [hi:] fit
    while lo < hi: mid = (lo + hi) // 2; fits(mid) ? hi = mid : lo = mid + 1

A "measure" maps k to bytes per device. The default, `CompiledMemory`, compiles the real train
step (`trn_accum.train.make_train_step`, abstract state and batch, as `trn-accum dry-run` does)
and takes what the dry-run reports as the compiled footprint: `memory_analysis()` arguments +
outputs - aliased (donated state) + temporaries. When compiling at full depth is slow (unrolled
layers), it compiles at two reduced depths L1 < L2 and extrapolates linearly in the layer count
(parameters, optimizer state and saved activations all grow by a fixed amount per layer):

    bytes(L) = bytes(L2) + (bytes(L2) - bytes(L1)) / (L2 - L1) * (L - L2)

Measured on the tiny Fuji (8 CPU devices, k=2), from 2 and 4 layers to 8: 3.8% above the
compiled figure with scanned layers, 1.1% below with unrolled ones. Depth 1 is not used: a
one-step layer scan compiles without its loop and breaks the line.

CPU figures are a proxy for trn2 (XLA:CPU computes bf16 dots in float32, FACTS.md §7): on CPU
the budget (`trainer.memory_budget_gib`) is whatever the user sets; on trn2 it is 24 GiB per
logical core.

Inject `measure` (any `k -> bytes` callable) to test the search without compiling.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

GIB = 1024**3
DEFAULT_DEPTHS = (2, 4)
FULL_DEPTH_LIMIT_S = 30.0  # predicted seconds per full-depth compile above which we extrapolate
DEPTH_MODES = ("auto", "full", "extrapolate")

__all__ = [
    "AutotuneError",
    "AutotuneResult",
    "CompiledMemory",
    "autotune",
    "candidate_steps",
    "compiled_bytes",
    "extrapolate",
    "resolve_accum_steps",
]


class AutotuneError(ValueError):
    """No candidate fits, or the backend cannot report compiled memory: one line."""


# ---------------------------------------------------------------------------------------------
# Pure pieces


def candidate_steps(batch_rows: int, batch_shards: int) -> tuple[int, ...]:
    """Every k >= 1 with `batch_rows` divisible by k x `batch_shards`, ascending."""
    if batch_rows < 1 or batch_shards < 1 or batch_rows % batch_shards:
        raise AutotuneError(
            f"batch of {batch_rows} rows is not divisible by the {batch_shards} batch shards "
            f"(data x fsdp) of the mesh: no accum_steps works; change data.global_batch or the mesh"
        )
    per_shard = batch_rows // batch_shards
    return tuple(k for k in range(1, per_shard + 1) if per_shard % k == 0)


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
        head = f'accum_steps = "auto": budget {_fmt_bytes(self.budget_bytes)} per device'
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
                lines.append(f"  {k:>4}  {_fmt_bytes(b):>18}  {fits}")
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
            f"{_fmt_bytes(table[k_max])} per device, over the budget of "
            f"{_fmt_bytes(budget_bytes)} ({method}: "
            + ", ".join(f"k={k}: {_fmt_bytes(b)}" for k, b in ordered.items())
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


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= 0.1 * scale:
            return f"{x / scale:.2f} {unit}"
    return f"{int(x)} B"


# ---------------------------------------------------------------------------------------------
# The real measure: compile the train step


def compiled_bytes(memory_stats: Any) -> int | None:
    """arguments + outputs - aliased + temporaries of a `compiled.memory_analysis()` (the
    dry-run's compiled footprint per device), or None if the backend gives none."""
    if memory_stats is None:
        return None

    def get(name: str) -> int:
        return int(getattr(memory_stats, f"{name}_size_in_bytes", 0) or 0)

    return get("argument") + get("output") - get("alias") + get("temp")


# (config with k and depth set, mesh, batch rows) -> (bytes, compile seconds). Compiles are
# deterministic: a dry-run followed by training in one process, or a test that measures a
# candidate itself, does not compile it twice.
_CACHE: dict[tuple, tuple[int, float]] = {}


def _compile_step_bytes(cfg, mesh, batch_rows: int) -> tuple[int, float]:
    """Compile the train step of `cfg` on `mesh` for a batch of `batch_rows` rows (abstract
    state and batch, as the dry-run) -> (bytes per device, seconds)."""
    key = (cfg, mesh, batch_rows)
    if key in _CACHE:
        return _CACHE[key]
    import jax  # noqa: PLC0415

    from trn_accum import train  # noqa: PLC0415 (train imports this module lazily too)

    t0 = time.perf_counter()
    tx, lr_fn = train.make_optimizer(cfg)
    specs = train.param_specs(cfg, mesh)
    abstract = train.abstract_state(cfg, tx)
    shardings = train.named(mesh, train.state_specs(tx, abstract, specs))
    step = train.make_train_step(cfg, mesh, tx, lr_fn, specs, shardings)
    with jax.set_mesh(mesh):
        compiled = step.lower(
            train.restore_target(abstract, shardings), train.abstract_batch(cfg, mesh, batch_rows)
        ).compile()
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        stats = None
    total = compiled_bytes(stats)
    if total is None:
        raise AutotuneError(
            f"accum_steps = auto: the {jax.default_backend()} backend reports no compiled memory; "
            "pick k with `trn-accum dry-run` on CPU and set trainer.accum_steps=K"
        )
    out = (total, time.perf_counter() - t0)
    _CACHE[key] = out
    return out


class CompiledMemory:
    """`measure(k) -> bytes per device` of the real train step with accum_steps = k.

    cfg: a `trn_accum.config.Config`; mesh: the mesh the step runs on; batch_rows: the rows of
    the compiled batch (default `cfg.data.global_batch`; the dry-run passes one node's rows).
    depth: "full" (compile num_layers), "extrapolate" (compile at `depths` and fit a line), or
    "auto": compile the first k at both reduced depths, predict the full-depth compile time
    from their times (linear in depth), and compile at full depth if that is at most
    `full_depth_limit_s`, else extrapolate for every k. Models no deeper than max(depths)
    always compile at full depth. `details[k]` records the depths compiled and the seconds.
    """

    def __init__(
        self,
        cfg,
        mesh,
        *,
        batch_rows: int | None = None,
        depth: str = "auto",
        depths: tuple[int, int] = DEFAULT_DEPTHS,
        full_depth_limit_s: float = FULL_DEPTH_LIMIT_S,
    ):
        if depth not in DEPTH_MODES:
            raise ValueError(f"depth={depth!r} must be one of {DEPTH_MODES}")
        l1, l2 = sorted(depths)
        if not 1 <= l1 < l2:
            raise ValueError(f"depths={depths!r} must be two different layer counts >= 1")
        self.cfg = cfg
        self.mesh = mesh
        self.batch_rows = cfg.data.global_batch if batch_rows is None else int(batch_rows)
        self.depths = (l1, l2)
        self.limit_s = float(full_depth_limit_s)
        self.layers = cfg.model.num_layers
        self.mode = "full" if self.layers <= l2 else depth
        self.details: dict[int, dict[str, Any]] = {}
        self.predicted_full_s: float | None = None

    @property
    def method(self) -> str:
        if self.mode == "extrapolate":
            l1, l2 = self.depths
            return (
                f"compiled at {l1} and {l2} layers, extrapolated linearly to {self.layers} "
                "(arguments + outputs - aliased + temporaries)"
            )
        return (
            f"compiled at full depth, {self.layers} layers "
            "(arguments + outputs - aliased + temporaries)"
        )

    def _at(self, k: int, layers: int) -> tuple[int, float]:
        # The budget does not change the program: normalise it so the compile cache hits.
        trainer = dataclasses.replace(self.cfg.trainer, accum_steps=k, memory_budget_gib=24.0)
        model = dataclasses.replace(self.cfg.model, num_layers=layers)
        cfg = dataclasses.replace(self.cfg, trainer=trainer, model=model)
        return _compile_step_bytes(cfg, self.mesh, self.batch_rows)

    def __call__(self, k: int) -> int:
        compiled: dict[int, int] = {}
        seconds = 0.0
        if self.mode in ("auto", "extrapolate"):
            times = {}
            for layers in self.depths:
                compiled[layers], times[layers] = self._at(k, layers)
                seconds += times[layers]
            if self.mode == "auto":
                l1, l2 = self.depths
                per_layer = max(0.0, times[l2] - times[l1]) / (l2 - l1)
                self.predicted_full_s = times[l2] + per_layer * (self.layers - l2)
                self.mode = "full" if self.predicted_full_s <= self.limit_s else "extrapolate"
        if self.mode == "full":
            b, s = self._at(k, self.layers)
            compiled[self.layers], seconds = b, seconds + s
            total = b
        else:
            total = extrapolate(compiled, self.layers)
        self.details[k] = {
            "bytes": total,
            "compiled_depths": {str(d): b for d, b in sorted(compiled.items())},
            "compile_s": round(seconds, 2),
        }
        return total


# ---------------------------------------------------------------------------------------------
# Config level


def resolve_accum_steps(
    cfg,
    mesh,
    *,
    batch_rows: int | None = None,
    measure: Callable[[int], int] | None = None,
    depth: str = "auto",
) -> tuple[Any, AutotuneResult | None]:
    """(cfg with trainer.accum_steps an int, the AutotuneResult or None if k was given).

    batch_rows: rows of the batch the step compiles for (default cfg.data.global_batch; one
    node's rows in a dry-run). The budget is cfg.trainer.memory_budget_gib per device; the
    batch shards are the mesh's data x fsdp. `measure` defaults to `CompiledMemory`.
    """
    if cfg.trainer.accum_steps != "auto":
        return cfg, None
    rows = cfg.data.global_batch if batch_rows is None else int(batch_rows)
    shards = math.prod(dict(mesh.shape).get(a, 1) for a in ("data", "fsdp"))
    cands = candidate_steps(rows, shards)
    if measure is None:
        measure = CompiledMemory(cfg, mesh, batch_rows=rows, depth=depth)
    budget = cfg.trainer.memory_budget_gib * GIB
    result = autotune(
        cands,
        measure,
        budget,
        context=f"batch {rows} rows over {shards} batch shards (data x fsdp)",
    )
    trainer = dataclasses.replace(cfg.trainer, accum_steps=result.accum_steps)
    return dataclasses.replace(cfg, trainer=trainer), result
