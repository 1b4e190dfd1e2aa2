"""`trainer.accum_steps = "auto"`: the smallest k whose compiled train step fits the budget.

The search is `trn_accum.analysis.autotune.autotune` (a binary search over the valid k); the
measure here compiles the real step (`trn_accum.train.step.build_step`, abstract state and
batch, as `trn-accum dry-run` does) and reads, by default, the fit check's figure: the peak
live bytes of the module the SPMD partitioner hands the backend, in the program's own dtypes
(`trn_accum.analysis.target_memory`). The trainer and the dry-run read that one figure, on any
backend, so a run picks the k its dry-run reported. Not the backend's own footprint
(`figure="compiled"`): on a TPU v5e the compiler fits an over-budget step by recomputing, and
its footprint then says "fits" for a slower step. Measured (docs/performance.md, "On the
chip"): the 4-layer proxy at seq 8192 resolved on the chip's footprint to k=1 (14.67 GB of
15.75 GiB) and ran 0.864 s a step; the estimate (20.77 GB) rules k=1 out, and k=2 ran 0.703 s.
When compiling at full depth is slow (unrolled layers), it compiles at two reduced depths and
extrapolates linearly in the layer count (`trn_accum.analysis.autotune.extrapolate`).

Measured on the tiny Fuji (8 CPU devices, k=2), from 2 and 4 layers to 8: 3.8% above the
compiled figure with scanned layers, 1.1% below with unrolled ones. Depth 1 is not used: a
one-step layer scan compiles without its loop and breaks the line.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from trn_accum.analysis.autotune import (
    GIB,
    AutotuneError,
    AutotuneResult,
    autotune,
    candidate_steps,
    extrapolate,
)
from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.analysis.live_bytes import peak_live_bytes
from trn_accum.analysis.target_memory import backend_peak, refused_bytes
from trn_accum.neuron.platform import DEVICE_BUDGET_GIB
from trn_accum.train import step as step_lib

DEFAULT_DEPTHS = (2, 4)
FULL_DEPTH_LIMIT_S = 30.0  # predicted seconds per full-depth compile above which we extrapolate
DEPTH_MODES = ("auto", "full", "extrapolate")
FIGURES = ("compiled", "target")


# (config with k and depth set, mesh, batch rows) -> (bytes, compile seconds). Compiles are
# deterministic: a dry-run followed by training in one process, or a test that measures a
# candidate itself, does not compile it twice.
_CACHE: dict[tuple, tuple[int, float]] = {}
FELL_BACK: set[tuple] = set()  # keys of _CACHE measured on the backend's footprint, not "target"


def _asked_if_refused(measure: Callable[[], int | None]) -> int | None:
    """measure(), or the bytes a compiler's out-of-memory refusal asked
    (`target_memory.refused_bytes`); any other error is raised."""
    try:
        return measure()
    except Exception as e:
        asked = refused_bytes(str(e))
        if asked is None:
            raise
        return asked


def _compile_step_bytes(cfg, mesh, batch_rows: int, figure: str) -> tuple[int, float]:
    """Compile the train step of `cfg` on `mesh` for a batch of `batch_rows` rows (abstract
    state and batch, as the dry-run) -> (bytes per device, seconds). `figure` (FIGURES):
    "target" (the default), the peak live bytes of the module the partitioner hands the backend
    (`trn_accum.analysis.target_memory`'s estimate, the dry-run's fit check on CPU); "compiled",
    this backend's compiled peak (`target_memory.backend_peak`: the TPU compiler's own peak,
    not the sum that holds every temporary live at once). A compiler's out-of-memory refusal
    counts at the bytes it asked (`target_memory.refused_bytes`). Where "target" cannot be read
    off an accelerator's compile (a plugin that refuses XLA's dump options) it is that
    backend's compiled peak instead."""
    key = (cfg, mesh, batch_rows, figure)
    if key in _CACHE:
        return _CACHE[key]
    t0 = time.perf_counter()
    program = step_lib.build_step(cfg, mesh, batch_rows=batch_rows)
    if figure == "target":
        try:
            total = _asked_if_refused(
                lambda: peak_live_bytes(compile_partitioned(program.lowered)[1])
            )
        except Exception:
            if jax.default_backend() == "cpu":
                raise
            # a plugin that takes no XLA dump options (the partitioned module is read from a
            # dump): this backend's own footprint instead, said in `CompiledMemory.method`
            FELL_BACK.add(key)
            total = _asked_if_refused(lambda: backend_peak(program.compiled))
    else:
        total = _asked_if_refused(lambda: backend_peak(program.compiled))
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
        figure: str = "target",
    ):
        if depth not in DEPTH_MODES:
            raise ValueError(f"depth={depth!r} must be one of {DEPTH_MODES}")
        if figure not in FIGURES:
            raise ValueError(f"figure={figure!r} must be one of {FIGURES}")
        self.figure = figure
        self.fell_back = False  # some "target" figure was the backend's footprint instead
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
        what = (
            "(the backend's compiled peak: target_memory.backend_peak)"
            if self.figure == "compiled"
            else "(the target's estimate: peak live bytes of the partitioned module)"
        )
        if self.fell_back:
            what += "; this backend took no dump options: its own footprint instead"
        if self.mode == "extrapolate":
            l1, l2 = self.depths
            return (
                f"compiled at {l1} and {l2} layers, extrapolated linearly to {self.layers} {what}"
            )
        return f"compiled at full depth, {self.layers} layers {what}"

    def _at(self, k: int, layers: int) -> tuple[int, float]:
        # The budget does not change the program: normalise it so the compile cache hits.
        trainer = dataclasses.replace(
            self.cfg.trainer, accum_steps=k, memory_budget_gib=DEVICE_BUDGET_GIB
        )
        model = dataclasses.replace(self.cfg.model, num_layers=layers)
        cfg = dataclasses.replace(self.cfg, trainer=trainer, model=model)
        out = _compile_step_bytes(cfg, self.mesh, self.batch_rows, self.figure)
        self.fell_back |= (cfg, self.mesh, self.batch_rows, self.figure) in FELL_BACK
        return out

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
    figure: str = "target",
) -> tuple[Any, AutotuneResult | None]:
    """(cfg with trainer.accum_steps an int, the AutotuneResult or None if k was given).

    batch_rows: rows of the batch the step compiles for (default cfg.data.global_batch; one
    node's rows in a dry-run). The budget is cfg.trainer.memory_budget_gib per device; the
    batch shards are the mesh's data x fsdp. `measure` defaults to `CompiledMemory` of
    `figure` ("target" or "compiled", see `_compile_step_bytes`).
    """
    if cfg.trainer.accum_steps != "auto":
        return cfg, None
    rows = cfg.data.global_batch if batch_rows is None else int(batch_rows)
    shards = step_lib.batch_shards(mesh)
    cands = candidate_steps(rows, shards)
    if measure is None:
        measure = CompiledMemory(cfg, mesh, batch_rows=rows, depth=depth, figure=figure)
    budget = cfg.trainer.memory_budget_gib * GIB
    result = autotune(
        cands,
        measure,
        budget,
        context=f"batch {rows} rows over {shards} batch shards (data x fsdp)",
    )
    trainer = dataclasses.replace(cfg.trainer, accum_steps=result.accum_steps)
    return dataclasses.replace(cfg, trainer=trainer), result
