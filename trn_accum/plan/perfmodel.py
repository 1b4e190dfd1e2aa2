"""The step-time model of a config on a platform (`trn_accum.analysis.platforms`; trn2 by
default), from compiled programs (`trn-accum dry-run --step-time`).

For the config and each candidate of `trn_accum.analysis.recommend` (mesh hybrid / reference,
nodes = the config's and 1, k over the values that fit, reduce both ways) this compiles the
real train step (`trn_accum.train.step.build_step`, abstract state and batch, the attention
the config ships) on `min(nodes, emulate_nodes)` emulated nodes of `layout.devices_per_node`
CPU devices each, with the per-device batch of the real run, and reads the module right after
XLA's SPMD partitioner (`trn_accum.analysis.partitioned`). The floor: its collectives priced
on the full mesh's peak links (`trn_accum.analysis.steptime`: the axes' real sizes, the link
of each group) and its dot FLOPs at peak. The prediction: every op priced at the platform's
fitted efficiencies (`trn_accum.analysis.pricing`), collectives on its achieved links. Two
emulated nodes are enough: a collective's full buffer does not depend on the size of the axes
it runs over, so the groups over "data" (hybrid) or over "fsdp" (reference) are priced at 32
nodes from a program where they span 2.

Deeper than `max(depths)` layers, each program is compiled at the two `depths` and the
summaries extrapolated per layer (`stepsummary.extrapolate_summary`, the line of
`trn_accum.analysis.autotune.extrapolate`). The analytic memory estimate
(`trn_accum.analysis.memory.fit_by_steps`) chooses which k to compile; a candidate fits by its
own compiled footprint at full depth (`compiled_fits`). The global `_HLO` cache keeps one
compile per program across the candidates and the scale table of one process.

`trn_accum.plan.perfmodel_cli.run_in_subprocess` runs `explore` in a fresh process with enough
emulated devices: the dry-run's own process has the devices of one node only.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax

from trn_accum.analysis import platforms, pricing, stepsummary, steptime
from trn_accum.analysis import recommend as rec
from trn_accum.analysis.autotune import extrapolate
from trn_accum.analysis.hlo import dot_flops
from trn_accum.analysis.memory import (
    GIB,
    compiled_memory,
    fit_by_steps,
    footprint,
    gather_once_bytes,
    state_shard_bytes,
)
from trn_accum.analysis.partitioned import compile_partitioned
from trn_accum.core.mesh import resolve_axes
from trn_accum.errors import UserError
from trn_accum.model import fuji
from trn_accum.neuron import platform
from trn_accum.train import step as step_lib

DEFAULT_DEPTHS = (2, 3)
EMULATE_NODES = 2
_HLO: dict[tuple, tuple[Any, Any, float]] = {}  # program -> (HLO module, footprint, s)


def _with(cfg, *, mesh: dict | None = None, k: int | None = None, reduce: str | None = None,
          layers: int | None = None, remat: str | None = None,
          gather: str | None = None):  # fmt: skip
    """cfg with mesh sizes / accum_steps / reduce / num_layers / remat / gather replaced."""
    m = cfg.mesh if mesh is None else dataclasses.replace(cfg.mesh, **mesh)
    t = dataclasses.replace(
        cfg.trainer,
        accum_steps=cfg.trainer.accum_steps if k is None else k,
        reduce=cfg.trainer.reduce if reduce is None else reduce,
        gather=cfg.trainer.gather if gather is None else gather,
    )
    mo = cfg.model if layers is None else dataclasses.replace(cfg.model, num_layers=layers)
    mo = mo if remat is None else dataclasses.replace(mo, remat=remat)
    return dataclasses.replace(cfg, mesh=m, trainer=t, model=mo)


def _compiled_module(cfg, devices, rows: int):
    """(the partitioned module, compiled footprint bytes per device, compile seconds) of the
    train step of `cfg` on `devices` with `rows` batch rows, cached (the global batch does not
    enter the program: one compile serves every node count of the same per-device batch).
    The module is the one right after XLA's SPMD partitioner (`compile_partitioned`: the
    dtypes the program wrote, what a Neuron or TPU compile starts from), with the attention
    the config ships; the footprint is the same compile's `memory_analysis`."""
    from trn_accum.analysis.hlo import parse_hlo

    shape = resolve_axes(cfg.mesh.axes(), len(devices))
    c = _with(cfg, mesh=shape)
    c = dataclasses.replace(c, data=dataclasses.replace(c.data, global_batch=rows))
    key = (c, len(devices), rows)
    if key not in _HLO:
        t0 = time.perf_counter()
        mesh = step_lib.make_mesh(c, devices)
        with kernel_stand_ins(c), jax.set_mesh(mesh):
            program = step_lib.build_step(c, mesh, batch_rows=rows)
            compiled, text = compile_partitioned(program.lowered)
        total = footprint(compiled_memory(compiled))
        _HLO[key] = (parse_hlo(text), total, time.perf_counter() - t0)
    return _HLO[key]


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
    gathered = gather_once_bytes(abstract["params"], specs, target_shape, step_lib.FSDP_AXES,
                                 cfg.model.compute_dtype, cfg.trainer.gather)  # fmt: skip
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
) -> dict:
    """The step-time summary of `cfg` (integer accum_steps) on `nodes` nodes of `plat`, with
    "depths_compiled", "compile_s", "target_mesh", "mesh_shape" (per node), "trips" (the
    loops' trip counts of the deepest compile) and "memory_bytes" (the compiled footprint per
    device at full depth: extrapolated per layer, the state shards of the compiled mesh
    replaced by those of the target mesh). The floor prices collectives on `layout`'s links
    and compute at peak; "predicted_step_s" prices every op at `plat.efficiency`
    (`trn_accum.analysis.pricing`) and collectives on `plat.achieved_links`."""
    devices = list(jax.devices() if devices is None else devices)
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
    fl = step_lib.flops_per_step(cfg)
    peak = plat.peak_flops * per_node * nodes
    achieved = dataclasses.replace(layout, links=plat.achieved_links)
    layers = cfg.model.num_layers
    at = sorted(depths) if layers > max(depths) else [layers]
    by_depth, mem, secs, module = {}, {}, 0.0, None
    for d in at:
        module, total, s = _compiled_module(_with(cfg, layers=d), devs, rows)
        secs += s
        mem[d] = total
        costs = steptime.collective_costs(module, compiled_shape, target, layout)
        comm_achieved = steptime.collective_costs(module, compiled_shape, target, achieved)
        features = pricing.op_features(module, plat.efficiency.tile)
        ops = {
            **features,
            **pricing.price(features, plat.peak_flops, plat.hbm_bytes_s, plat.efficiency),
        }
        # weak scaling: every device runs the same per-device program at any node count
        executed = dot_flops(module)["with_trips"] * per_node * nodes
        fl_d = step_lib.flops_per_step(_with(cfg, layers=d)) if len(at) == 2 else fl
        by_depth[d] = stepsummary.summarize(
            costs, flops_per_step=fl_d["total"], peak_flops=peak, tokens_per_step=fl["tokens"],
            accum_steps=k, flops_executed_per_step=executed, ops=ops,
            comm_predicted_s=sum(c.time_s for c in comm_achieved),
            overlap=plat.overlap,
        )  # fmt: skip
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


def _variant_rows(cfg, b, field: str, values, *, meshes, nodes, layout, budget, fit_ks, kw):
    """Rows of candidate `b` with `field` ("remat" or "gather") set to each of `values` whose
    analytic bytes fit at b's k; `fit_ks` gets the fitting ks of each value."""
    out = []
    for value in values:
        picks = {"remat": b.remat, "gather": b.gather, field: value}
        c = _with(cfg, mesh=meshes[b.mesh], k=b.k, reduce=b.reduce, **picks)
        f = fitting_k(c, meshes[b.mesh], nodes, layout)
        ks = [r["k"] for r in f["table"] if r["bytes"] <= budget]
        fit_ks[(f"{b.mesh} {field}={value}", nodes)] = ks
        if b.k in ks:
            cand = dataclasses.replace(b, **{field: value})
            summary = predict(c, nodes=nodes, **kw)
            out.append(
                {"candidate": cand, "fits": compiled_fits(summary, budget), "summary": summary}
            )
    return out


def compiled_fits(summary: dict, budget: float) -> bool:
    """Whether a candidate's own compiled footprint at full depth ("memory_bytes") fits
    `budget` bytes (False when the backend reported no memory)."""
    mem = summary.get("memory_bytes")
    return mem is not None and mem <= budget


def _has_data(row) -> bool:
    """The candidate's full mesh has a data axis (else "once" is per_minibatch)."""
    return row["summary"].get("target_mesh", {}).get("data", 1) > 1


def fitting_k(
    cfg, mesh_axes: dict, nodes: int, layout: steptime.Layout, budget: float | None = None
) -> dict[str, Any]:
    """`fit_by_steps` of `cfg` on `mesh_axes` at `nodes` nodes (analytic, budget in bytes,
    default trainer.memory_budget_gib)."""
    c = _with(cfg, mesh=mesh_axes)
    target = resolve_axes(mesh_axes, layout.devices_per_node * nodes)
    per_node = resolve_axes(mesh_axes, layout.devices_per_node)
    budget = cfg.trainer.memory_budget_gib * GIB if budget is None else budget
    return fit_by_steps(c, per_node, _state_bytes(c, target), nodes, budget)


def _resolves(axes: dict, devices: int) -> bool:
    try:
        resolve_axes(axes, devices)
    except ValueError:
        return False
    return True


SCALE_NODES = (1, 2, 4, 8, 16, 32, 64, 128)


def explore(
    cfg,
    *,
    nodes: int,
    layout: steptime.Layout,
    devices=None,
    meshes=None,
    k_limit: int = 2,
    depths=DEFAULT_DEPTHS,
    emulate_nodes: int = EMULATE_NODES,
    scale_nodes: Sequence[int] = SCALE_NODES,
    remats: Sequence[str] = fuji.REMAT_POLICIES,
    gathers: Sequence[str] = ("once", "once_unsharded"),
    plat: platforms.Platform = platforms.TRN2,
) -> dict[str, Any]:
    """The config's prediction, every candidate's (fit, summary), the recommendation and the
    weak-scaling table of the recommended choice.

    Candidates: every mesh of `meshes` (default `recommend.MESHES`: the model axis 4, 2, 1 with
    FSDP over the rest of a node, and FSDP over every node) at the config's node count, the
    `k_limit` smallest k whose analytic bytes fit trainer.memory_budget_gib (a lower bound:
    nothing below it can fit), both reduce modes; a candidate fits by that estimate. Then the
    fastest of them with each other remat policy of `remats` whose analytic bytes fit at its k
    (a second stage: remat changes compute and memory, not the collectives' layout); then
    the fastest reduce="once" candidate with a data axis with each trainer.gather of `gathers`
    whose analytic bytes (with `gather_once_bytes`) fit at its k. The analytic bytes only
    choose which k to compile (a lower bound: nothing below it can fit); a candidate "fits"
    when its own compiled footprint ("memory_bytes", XLA:CPU's: bf16 temporaries kept in
    float32, so an overstatement on trn2) fits the budget (trainer.memory_budget_gib, at most
    the platform's device memory). Meshes that do not divide a node's devices are left out.
    Ranked by "predicted_step_s". The scale table: the recommended mesh, k and reduce at each
    node count of `scale_nodes`, the per-node batch of the config (weak scaling)."""
    t0 = time.perf_counter()
    meshes = rec.MESHES if meshes is None else meshes
    meshes = {m: a for m, a in meshes.items() if _resolves(a, layout.devices_per_node)}
    kw = dict(layout=layout, devices=devices, depths=depths, emulate_nodes=emulate_nodes, plat=plat)
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    fits = {m: fitting_k(cfg, axes, nodes, layout, budget) for m, axes in meshes.items()}
    fit_ks = {(m, nodes): [r["k"] for r in f["table"] if r["bytes"] <= budget]
              for m, f in fits.items()}  # fmt: skip
    rows, seen = [], set()
    for cand in rec.candidate_grid(fit_ks, k_limit=k_limit):
        target = resolve_axes(meshes[cand.mesh], layout.devices_per_node * cand.nodes)
        # once = per_minibatch without a data axis to reduce over (core/reduce_once.py)
        effective = cand.reduce if target["data"] > 1 else "per_minibatch"
        same = (tuple(target.items()), cand.k, effective)
        if same in seen:
            continue
        seen.add(same)
        c = _with(cfg, mesh=meshes[cand.mesh], k=cand.k, reduce=cand.reduce)
        summary = predict(c, nodes=cand.nodes, **kw)
        rows.append({"candidate": cand, "fits": compiled_fits(summary, budget), "summary": summary})
    best = rec.recommend(rows, nodes)
    variant = functools.partial(_variant_rows, cfg, meshes=meshes, nodes=nodes, layout=layout,
                                budget=budget, fit_ks=fit_ks, kw=kw)  # fmt: skip
    if best is not None:  # the other remat policies, on the fastest candidate only
        others = [p for p in remats if p != cfg.model.remat]
        rows += variant(rec.Candidate(**best["candidate"]), "remat", others)
        best = rec.recommend(rows, nodes)
    # the gather options on the fastest reduce="once" candidate that has a data axis
    once_rows = [r for r in rows if r["candidate"].reduce == "once" and _has_data(r)]
    if once_rows and gathers:
        rows += variant(min(once_rows, key=rec.sort_key)["candidate"], "gather", gathers)
        best = rec.recommend(rows, nodes)
    own = predict(cfg, nodes=nodes, **kw)
    shapes = {r["candidate"]: r["summary"]["mesh_shape"] for r in rows}
    scale = []
    if best is not None:
        b = rec.Candidate(**best["candidate"])
        best["candidate"] = {**best["candidate"], "mesh_shape": shapes[b]}
        scale = scale_table(_with(cfg, mesh=meshes[b.mesh], k=b.k, reduce=b.reduce,
                                  remat=b.remat, gather=b.gather), nodes, scale_nodes,
                            **kw)  # fmt: skip
    return {
        "config": {
            "mesh": cfg.mesh.axes(),
            "nodes": nodes,
            "k": cfg.trainer.accum_steps,
            "reduce": cfg.trainer.reduce,
            "summary": own,
            "fits": compiled_fits(own, budget),
        },  # fmt: skip
        "platform": plat.name,
        "fit_k": {f"{m} x{n}": ks for (m, n), ks in fit_ks.items()},
        "budget_bytes": budget,
        "candidates": [
            {
                **r,
                "candidate": {
                    **dataclasses.asdict(r["candidate"]),
                    "mesh_shape": shapes[r["candidate"]],
                },
            }
            for r in rows
        ],  # fmt: skip
        "table": rec.format_rows(rows),
        "recommendation": best,
        "scale": scale,
        "layout": dataclasses.asdict(layout),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def scale_table(cfg, nodes: int, node_counts: Sequence[int], **kw) -> list[dict[str, Any]]:
    """Weak scaling: `cfg` at each node count with the per-node batch it has at `nodes`
    (global batch = per-node batch x node count). Counts whose batch does not divide are left
    out. Rows {nodes, global_batch, step_s_no_overlap, step_s_full_overlap, mfu: [no overlap,
    full overlap], predicted_step_s, predicted_mfu}; one compile at 1 node and one at
    `EMULATE_NODES` serve every count."""
    per_node = cfg.data.global_batch // nodes
    out = []
    for n in node_counts:
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch=per_node * n))
        try:
            s = predict(c, nodes=n, **kw)
        except (ValueError, UserError):
            continue
        out.append({
            "nodes": n, "global_batch": per_node * n,
            "step_s_no_overlap": s["step_s_no_overlap"],
            "step_s_full_overlap": s["step_s_full_overlap"], "mfu": s["mfu"],
            "predicted_step_s": s["predicted_step_s"], "predicted_mfu": s["predicted_mfu"],
            "efa_wire_bytes": s["by_link"].get(platform.LINK_EFA, {}).get("wire_bytes", 0.0),
        })  # fmt: skip
    return out


class StepTimeError(UserError):
    """The step-time model could not compile or price the config (e.g. a mesh or batch that
    the trn2 candidate meshes do not divide); the dry-run reports it and goes on."""
