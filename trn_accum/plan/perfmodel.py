"""The step-time model of a config on a platform (`trn_accum.analysis.platforms`; trn2 by
default), from compiled programs (`trn-accum dry-run --step-time`).

For the config and each candidate of `trn_accum.analysis.recommend` (mesh hybrid / reference,
nodes = the config's and 1, k over the values that fit, reduce both ways) this compiles the
real train step (`trn_accum.train.step.build_step`, abstract state and batch, the attention
the config ships) on `min(nodes, emulate_nodes)` emulated nodes of `layout.devices_per_node`
CPU devices each, with the per-device batch of the real run, and reads the module right after
XLA's SPMD partitioner (`trn_accum.analysis.hlo.partitioned`). The floor: its collectives priced
on the full mesh's peak links (`trn_accum.analysis.steptime`: the axes' real sizes, the link
of each group) and its dot FLOPs at peak. The prediction: every op priced at the platform's
fitted efficiencies (`trn_accum.analysis.pricing`), collectives on its achieved links. Two
emulated nodes are enough: a collective's full buffer does not depend on the size of the axes
it runs over, so the groups over "data" (hybrid) or over "fsdp" (reference) are priced at 32
nodes from a program where they span 2.

Deeper than `max(depths)` layers, each program is compiled at the two `depths` and the
summaries extrapolated per layer (`stepsummary.extrapolate_summary`, the line of
`trn_accum.analysis.memory.extrapolate`). The analytic memory estimate
(`trn_accum.analysis.memory.fit_by_steps`) chooses which k to compile; a candidate fits by its
own program's peak live bytes at full depth (`compiled_fits`). A `Programs` cache, held by the
search (`trn_accum.plan.search.explore`), keeps one compile per program across its candidates
and its scale table.

`trn_accum.plan.perfmodel_cli.start_in_subprocess` runs the search in a fresh process with enough
emulated devices: the dry-run's own process has the devices of one node only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from trn_accum.analysis import platforms, pricing, stepsummary, steptime
from trn_accum.analysis.hlo.module import dot_flops, parse_hlo
from trn_accum.analysis.hlo.partitioned import compile_partitioned
from trn_accum.analysis.live_bytes import peak_live_bytes
from trn_accum.analysis.memory import (
    GIB,
    extrapolate,
    fit_by_steps,
    gather_once_bytes,
    state_shard_bytes,
)
from trn_accum.core.mesh import resolve_axes
from trn_accum.errors import UserError
from trn_accum.model import fuji
from trn_accum.train import step as step_lib
from trn_accum.train.flops import flops_per_step

DEFAULT_DEPTHS = (2, 3)


EMULATE_NODES = 2


def with_choices(
    cfg,
    *,
    mesh: dict | None = None,
    k: int | None = None,
    reduce: str | None = None,
    layers: int | None = None,
    remat: str | None = None,
    gather: str | None = None,
    attention_block: int | None = None,
    attention: str | None = None,
    loss_chunk: int | None = None,
):
    """cfg with mesh sizes / accum_steps / reduce / num_layers / remat / gather / attention /
    attention_block / loss_chunk replaced (None: kept)."""
    m = cfg.mesh if mesh is None else dataclasses.replace(cfg.mesh, **mesh)
    t = dataclasses.replace(
        cfg.trainer,
        accum_steps=cfg.trainer.accum_steps if k is None else k,
        reduce=cfg.trainer.reduce if reduce is None else reduce,
        gather=cfg.trainer.gather if gather is None else gather,
    )
    mo = cfg.model if layers is None else dataclasses.replace(cfg.model, num_layers=layers)
    mo = mo if remat is None else dataclasses.replace(mo, remat=remat)
    model = {"attention": attention, "attention_block": attention_block, "loss_chunk": loss_chunk}
    mo = dataclasses.replace(mo, **{k: v for k, v in model.items() if v is not None})
    return dataclasses.replace(cfg, mesh=m, trainer=t, model=mo)


class Programs:
    """Compiled train-step programs by (config, devices, rows): the partitioned module, its
    peak live bytes per device and the compile seconds. A search (`explore`) holds one,
    so a program is compiled once across its candidates and scale table; `predict` without one
    compiles afresh."""

    def __init__(self):
        self._compiled: dict[tuple, tuple[Any, Any, float]] = {}

    def module(self, cfg, devices, rows: int):
        """(the partitioned module, its peak live bytes per device, compile seconds) of
        the train step of `cfg` on `devices` with `rows` batch rows (the global batch does not
        enter the program: one compile serves every node count of the same per-device batch).
        The module is the one right after XLA's SPMD partitioner (`compile_partitioned`: the
        dtypes the program wrote, what a Neuron or TPU compile starts from), with the attention
        the config ships; the bytes are that module's peak live bytes per device
        (`trn_accum.analysis.live_bytes`, the dry-run's fit check on CPU), not XLA:CPU's
        footprint, which keeps bf16 temporaries in float32 (the 4-layer proxy's k 2 step on a
        TPU v5e: 22.45 GB by XLA:CPU, 15.43 GB by the chip's compiler, docs/performance.md)."""
        shape = resolve_axes(cfg.mesh.axes(), len(devices))
        c = with_choices(cfg, mesh=shape)
        c = dataclasses.replace(c, data=dataclasses.replace(c.data, global_batch=rows))
        key = (repr(c), len(devices), rows)  # a config may hold lists (data.path): unhashable
        if key not in self._compiled:
            t0 = time.perf_counter()
            mesh = step_lib.make_mesh(c, devices)
            with kernel_stand_ins(c), jax.set_mesh(mesh):
                program = step_lib.build_step(c, mesh, batch_rows=rows)
                compiled, text = compile_partitioned(program.lowered)
            total = peak_live_bytes(text)  # the fit check's figure, not XLA:CPU's footprint
            self._compiled[key] = (parse_hlo(text), total, time.perf_counter() - t0)
        return self._compiled[key]


def kernel_stand_ins(cfg):
    """The NKI kernels' JAX stand-ins while `cfg` names attention "neuron_flash" (no CPU
    kernel; `trn_accum.neuron.kernels.reference_kernels`), else nothing."""
    import contextlib

    from trn_accum.neuron import kernels

    if cfg.model.attention != "neuron_flash":
        return contextlib.nullcontext()
    return kernels.substitute(kernels.reference_kernels())


def _state_bytes(cfg, target_shape: dict) -> int:
    """Per-device params + optimizer state + two float32 gradients (accumulator and one
    minibatch's) on the full mesh, + what trainer.gather keeps (`gather_once_bytes`)."""
    tx, _ = step_lib.make_optimizer(cfg)
    abstract = step_lib.abstract_state(cfg, tx)
    specs = fuji.param_specs(cfg.model, cfg.mesh.rules, target_shape)
    sspecs = step_lib.state_specs(tx, abstract, specs)
    b = state_shard_bytes(abstract, specs, sspecs["opt_state"], target_shape)
    gathered = gather_once_bytes(
        abstract["params"],
        specs,
        target_shape,
        step_lib.FSDP_AXES,
        cfg.model.compute_dtype,
        cfg.trainer.gather,
    )
    return b["params"] + b["opt_state"] + 2 * b["grads"] + gathered


def predict(
    cfg,
    *,
    nodes: int,
    layout: steptime.Layout,
    devices=None,
    emulate_nodes: int = EMULATE_NODES,
    depths=DEFAULT_DEPTHS,
    plat: platforms.Platform = platforms.TRN2,
    programs: Programs | None = None,
) -> dict:
    """The step-time summary of `cfg` (integer accum_steps) on `nodes` nodes of `plat`, with
    "depths_compiled", "compile_s", "target_mesh", "mesh_shape" (per node), "trips" (the
    loops' trip counts of the deepest compile) and "memory_bytes" (the peak live bytes per
    device at full depth: extrapolated per layer, the state shards of the compiled mesh
    replaced by those of the target mesh). The floor prices collectives on `layout`'s links
    and compute at peak; "predicted_step_s" prices every op at `plat.efficiency`
    (`trn_accum.analysis.pricing`) and collectives on `plat.achieved_links`. `programs`: the
    compiled programs to reuse (default: compile afresh)."""
    devices = list(jax.devices() if devices is None else devices)
    programs = Programs() if programs is None else programs
    e = min(nodes, emulate_nodes)
    per_node = layout.devices_per_node
    if len(devices) < e * per_node:
        raise ValueError(f"step-time model: {e} nodes of {per_node} need {e * per_node} devices")
    devs = devices[: e * per_node]
    b = cfg.data.global_batch
    if b % nodes:
        raise ValueError(f"global batch {b} does not split over {nodes} nodes")
    rows = b // nodes * e
    compiled_shape = resolve_axes(cfg.mesh.axes(), len(devs))
    target = resolve_axes(cfg.mesh.axes(), per_node * nodes)
    k = cfg.trainer.accum_steps
    fl = flops_per_step(cfg)
    peak = plat.peak_flops * per_node * nodes
    achieved = dataclasses.replace(layout, links=plat.achieved_links)
    layers = cfg.model.num_layers
    at = sorted(depths) if layers > max(depths) else [layers]
    by_depth, mem, secs, module = {}, {}, 0.0, None
    for d in at:
        module, total, s = programs.module(with_choices(cfg, layers=d), devs, rows)
        secs += s
        mem[d] = total
        costs = steptime.collective_costs(module, compiled_shape, target, layout)
        comm_achieved = steptime.collective_costs(module, compiled_shape, target, achieved)
        eff = plat.efficiency
        features = pricing.op_features(module, eff.tile, eff.rates, eff.onchip_bytes)
        ops = {
            **features,
            **pricing.price(features, plat.peak_flops, plat.hbm_bytes_s, plat.efficiency),
        }
        # weak scaling: every device runs the same per-device program at any node count
        executed = dot_flops(module)["with_trips"] * per_node * nodes
        fl_d = flops_per_step(with_choices(cfg, layers=d)) if len(at) == 2 else fl
        by_depth[d] = stepsummary.summarize(
            costs,
            flops_per_step=fl_d["total"],
            peak_flops=peak,
            tokens_per_step=fl["tokens"],
            accum_steps=k,
            flops_executed_per_step=executed,
            ops=ops,
            comm_predicted_s=sum(c.time_s for c in comm_achieved),
            overlap=plat.overlap,
        )
    if len(at) == 1:
        out = by_depth[layers]
    else:
        out = stepsummary.extrapolate_summary(by_depth, layers)
        out = stepsummary.bounds(
            out, fl["total"], peak, fl["tokens"], out["flops_executed_per_step"]
        )  # useful FLOPs of the full depth
    memory = None
    if all(v is not None for v in mem.values()):
        full = mem[layers] if len(at) == 1 else extrapolate(mem, layers)
        memory = full - _state_bytes(cfg, compiled_shape) + _state_bytes(cfg, target)
    return {
        **out,
        "depths_compiled": at,
        "compile_s": round(secs, 2),
        "target_mesh": target,
        "mesh_shape": resolve_axes(cfg.mesh.axes(), per_node) if nodes > 1 else target,
        "trips": stepsummary.trip_counts(module),
        "memory_bytes": memory,
    }


def compiled_fits(summary: dict, budget: float) -> bool:
    """Whether a candidate's own peak live bytes at full depth ("memory_bytes") fit
    `budget` bytes (False when the backend reported no memory)."""
    mem = summary.get("memory_bytes")
    return mem is not None and mem <= budget


def fitting_k(
    cfg, mesh_axes: dict, nodes: int, layout: steptime.Layout, budget: float | None = None
) -> dict[str, Any]:
    """`fit_by_steps` of `cfg` on `mesh_axes` at `nodes` nodes (analytic, budget in bytes,
    default trainer.memory_budget_gib)."""
    c = with_choices(cfg, mesh=mesh_axes)
    target = resolve_axes(mesh_axes, layout.devices_per_node * nodes)
    per_node = resolve_axes(mesh_axes, layout.devices_per_node)
    budget = cfg.trainer.memory_budget_gib * GIB if budget is None else budget
    return fit_by_steps(c, per_node, _state_bytes(c, target), nodes, budget)


class StepTimeError(UserError):
    """The step-time model could not compile or price the config (e.g. a mesh or batch that
    the trn2 candidate meshes do not divide); the dry-run reports it and goes on."""
