"""The step-time model's search (`trn-accum dry-run --step-time`): every candidate of
`trn_accum.analysis.recommend` priced by `trn_accum.plan.perfmodel.predict` (meshes, the k that
fit, both reduce modes; then the other remat policies, trainer.gather options and attention
blocks on the fastest), the recommendation, and the weak-scaling table of the recommended
choice. One `Programs` cache per search: a program compiled once serves every candidate and
node count that share it."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

from trn_accum.analysis import platforms, steptime
from trn_accum.analysis import recommend as rec
from trn_accum.analysis.memory import GIB
from trn_accum.config.mesh_rules import BATCH_AXES
from trn_accum.core.batch_rules import divisibility_error
from trn_accum.core.mesh import resolve_axes
from trn_accum.model import fuji
from trn_accum.model.attention import BLOCKED
from trn_accum.neuron import platform
from trn_accum.plan.perfmodel import (
    DEFAULT_DEPTHS,
    EMULATE_NODES,
    Programs,
    compiled_fits,
    fitting_k,
    predict,
    with_choices,
)

# model.attention_block values the search tries (with blockwise or flash attention): on a TPU
# v5e 512 and 1024 were the fastest in the 4-layer proxy's step and in attention alone, 2048
# the slowest of the three in both (docs/performance.md, "On the chip")
ATTENTION_BLOCKS = (512, 1024)


def variant_rows(cfg, b, field: str, values, *, meshes, nodes, layout, budget, fit_ks, kw):
    """Rows of candidate `b` with `field` ("remat", "gather" or "attention_block") set to each
    of `values` whose analytic bytes fit at b's k; `fit_ks` gets the fitting ks of each value."""
    out = []
    for value in values:
        picks = {**b.choices(), field: value}
        c = with_choices(cfg, mesh=meshes[b.mesh], k=b.k, reduce=b.reduce, **picks)
        ks = compile_ks(fitting_k(c, meshes[b.mesh], nodes, layout)["table"], budget)
        fit_ks[(f"{b.mesh} {field}={value}", nodes)] = ks
        if b.k in ks:
            cand = dataclasses.replace(b, **{field: value})
            summary = predict(c, nodes=nodes, **kw)
            out.append(
                {"candidate": cand, "fits": compiled_fits(summary, budget), "summary": summary}
            )
    return out


def compile_ks(table: Sequence[dict], budget: float) -> list[int]:
    """The ks of an analytic fit table (`fit_by_steps`'s rows {k, bytes}) worth compiling:
    those whose analytic bytes fit `budget`; where none does, the largest k (the fewest rows a
    minibatch), so that the compiled figure decides. The analytic estimate overstates remat
    none at long sequences: the 4-layer proxy at seq 8192, k 2, 24.81 GB analytic where a TPU
    v5e's compiler put the step at 14.91 GB (docs/performance.md)."""
    ks = [r["k"] for r in table if r["bytes"] <= budget]
    return ks or [max(r["k"] for r in table)] if table else []


def with_config_mesh(cfg, meshes: dict, devices: int) -> dict:
    """`meshes` and, as "config", the config's own mesh where it resolves on `devices` (the
    whole job) to a shape none of them has: on one TPU device the only one that resolves."""
    own = cfg.mesh.axes()
    if not _resolves(own, devices):
        return dict(meshes)
    shapes = [resolve_axes(a, devices) for a in meshes.values() if _resolves(a, devices)]
    if resolve_axes(own, devices) in shapes:
        return dict(meshes)
    return {**meshes, "config": own}


def _has_data(row) -> bool:
    """The candidate's full mesh has a data axis (else "once" is per_minibatch)."""
    return row["summary"].get("target_mesh", {}).get("data", 1) > 1


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
    remats: Sequence[str] | None = None,
    gathers: Sequence[str] = ("once", "once_unsharded"),
    attention_blocks: Sequence[int] = ATTENTION_BLOCKS,
    plat: platforms.Platform = platforms.TRN2,
) -> dict[str, Any]:
    """The config's prediction, every candidate's (fit, summary), the recommendation and the
    weak-scaling table of the recommended choice.

    Candidates: every mesh of `meshes` (default `recommend.MESHES`: the model axis 4, 2, 1 with
    FSDP over the rest of a node, and FSDP over every node; and the config's own, "config")
    at the config's node count, the `k_limit` smallest k whose analytic bytes fit
    trainer.memory_budget_gib (or the largest k where none does: `compile_ks`), both reduce
    modes. Then the
    fastest of them with each other remat policy of `remats` (default: those that make another
    program with the config's attention, `fuji.distinct_remat_policies`) whose analytic bytes
    fit at its k (a second stage: remat changes compute and memory, not the collectives'
    layout); then
    the fastest reduce="once" candidate with a data axis with each trainer.gather of `gathers`
    whose analytic bytes (with `gather_once_bytes`) fit at its k; then, where the attention
    takes a block (`attention.BLOCKED`), the recommendation so far with each other
    model.attention_block of `attention_blocks` (at most the sequence) whose analytic bytes
    fit at its k. The analytic bytes only choose which k to compile (`compile_ks`); a
    candidate "fits" when its own program's peak live bytes
    ("memory_bytes", the fit check's estimate of the module the partitioner hands the backend,
    `perfmodel.Programs`) fit the budget (trainer.memory_budget_gib, at most the platform's
    device memory). Meshes that do not divide a node's devices are left out. Ranked by
    "predicted_step_s"; the pick's fit is then checked on a compile at full depth
    (`checked_at_full_depth`: a pick that does not fit there gives way). The scale table:
    the recommended mesh, k and reduce at each node count of `scale_nodes`, the per-node
    batch of the config (weak scaling)."""
    t0 = time.perf_counter()
    if meshes is None:
        meshes = with_config_mesh(cfg, rec.MESHES, layout.devices_per_node * nodes)
    meshes = {m: a for m, a in meshes.items() if _resolves(a, layout.devices_per_node)}
    kw = dict(
        layout=layout,
        devices=devices,
        depths=depths,
        emulate_nodes=emulate_nodes,
        plat=plat,
        programs=Programs(),  # one compile per program across the candidates and the scale
    )
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    fits = {m: fitting_k(cfg, axes, nodes, layout, budget) for m, axes in meshes.items()}
    fit_ks = {(m, nodes): compile_ks(f["table"], budget) for m, f in fits.items()}
    rows, seen = [], set()
    for cand in rec.candidate_grid(fit_ks, k_limit=k_limit):
        target = resolve_axes(meshes[cand.mesh], layout.devices_per_node * cand.nodes)
        # once = per_minibatch without a data axis to reduce over (core/reduce_once.py)
        effective = cand.reduce if target["data"] > 1 else "per_minibatch"
        same = (tuple(target.items()), cand.k, effective)
        if same in seen:
            continue
        seen.add(same)
        c = with_choices(cfg, mesh=meshes[cand.mesh], k=cand.k, reduce=cand.reduce)
        summary = predict(c, nodes=cand.nodes, **kw)
        rows.append({"candidate": cand, "fits": compiled_fits(summary, budget), "summary": summary})
    best = rec.recommend(rows, nodes)
    variant = functools.partial(
        variant_rows,
        cfg,
        meshes=meshes,
        nodes=nodes,
        layout=layout,
        budget=budget,
        fit_ks=fit_ks,
        kw=kw,
    )
    if best is not None:  # the other remat policies, on the fastest candidate only
        policies = fuji.distinct_remat_policies(cfg.model.attention) if remats is None else remats
        others = [p for p in policies if p != cfg.model.remat]
        rows += variant(rec.Candidate(**best["candidate"]), "remat", others)
    # the gather options on the fastest reduce="once" candidate that has a data axis
    once_rows = [r for r in rows if r["candidate"].reduce == "once" and _has_data(r)]
    if once_rows and gathers:
        rows += variant(min(once_rows, key=rec.sort_key)["candidate"], "gather", gathers)
    blocks = [
        b for b in attention_blocks if b != cfg.model.attention_block and b <= cfg.data.seq_len
    ]
    pick = rec.recommend(rows, nodes)
    if blocks and cfg.model.attention in BLOCKED and pick is not None:
        rows += variant(rec.Candidate(**pick["candidate"]), "attention_block", blocks)
    best = checked_at_full_depth(cfg, rows, nodes, meshes, budget, kw)
    own = predict(cfg, nodes=nodes, **kw)
    shapes = {r["candidate"]: r["summary"]["mesh_shape"] for r in rows}
    scale = []
    if best is not None:
        b = rec.Candidate(**best["candidate"])
        best["candidate"] = {**best["candidate"], "mesh_shape": shapes[b]}
        scale = scale_table(
            with_choices(cfg, mesh=meshes[b.mesh], k=b.k, reduce=b.reduce, **b.choices()),
            nodes,
            scale_nodes,
            **kw,
        )
    return {
        **_report(cfg, own, nodes, plat, budget, layout, t0),
        "fit_k": {f"{m} x{n}": ks for (m, n), ks in fit_ks.items()},
        "candidates": [
            {
                **r,
                "candidate": {
                    **dataclasses.asdict(r["candidate"]),
                    "mesh_shape": shapes[r["candidate"]],
                },
            }
            for r in rows
        ],
        "table": rec.format_rows(rows),
        "recommendation": best,
        "scale": scale,
    }


def _report(cfg, own: dict, nodes: int, plat, budget: float, layout, t0: float) -> dict:
    """The parts of a step-time report every search has: the config's own prediction and fit,
    the platform, budget and layout, and the wall time since `t0`; no candidates."""
    return {
        "config": {
            "mesh": cfg.mesh.axes(),
            "nodes": nodes,
            "k": cfg.trainer.accum_steps,
            "reduce": cfg.trainer.reduce,
            "summary": own,
            "fits": compiled_fits(own, budget),
        },
        "platform": plat.name,
        "fit_k": {},
        "budget_bytes": budget,
        "candidates": [],
        "table": [],
        "recommendation": None,
        "scale": [],
        "layout": dataclasses.asdict(layout),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def price_config(
    cfg,
    *,
    nodes: int,
    layout: steptime.Layout,
    plat: platforms.Platform = platforms.TRN2,
    depths=DEFAULT_DEPTHS,
) -> dict[str, Any]:
    """The step-time model of the config as written (resolved) alone, shaped like `explore`'s
    report with no candidates: what `trn-accum dry-run` prints by default (`--search` runs
    `explore`)."""
    t0 = time.perf_counter()
    budget = plat.budget_gib(cfg.trainer.memory_budget_gib) * GIB
    own = predict(cfg, nodes=nodes, layout=layout, depths=depths, plat=plat)
    return _report(cfg, own, nodes, plat, budget, layout, t0)


def checked_at_full_depth(cfg, rows, nodes: int, meshes, budget: float, kw) -> dict | None:
    """`rec.recommend(rows, nodes)` once the pick's fit is checked on a compile of the full
    depth: a row's footprint is extrapolated from `kw["depths"]` layers, which reads low for
    the per-device program (the 3B config's k=1 per_minibatch at 32 nodes: 16.70 GiB
    extrapolated, 25.88 GiB at 28 layers). The pick's row gets "memory_bytes_full_depth" and
    its "fits" from it; one that does not fit is passed over for the next pick."""
    layers = cfg.model.num_layers
    while True:
        best = rec.recommend(rows, nodes)
        if best is None or layers <= max(kw["depths"]):
            return best
        cand = rec.Candidate(**best["candidate"])
        row = next(r for r in rows if r["candidate"] == cand)
        if "memory_bytes_full_depth" in row["summary"]:
            return best
        c = with_choices(
            cfg, mesh=meshes[cand.mesh], k=cand.k, reduce=cand.reduce, **cand.choices()
        )
        full = predict(c, nodes=nodes, **{**kw, "depths": (layers,)})
        row["summary"]["memory_bytes_full_depth"] = full["memory_bytes"]
        row["fits"] = compiled_fits(full, budget)


def scale_point_fits(cfg, nodes: int, layout: steptime.Layout, emulate_nodes: int) -> bool:
    """Whether `cfg` (its global batch for `nodes` nodes) can be priced at `nodes`: its mesh
    resolves on the full job and on the emulated nodes, the full job's mesh divides every
    weight (`fuji.param_specs`), and the emulated batch rows split into accum_steps
    minibatches over the emulated batch shards."""
    e, per_node = min(nodes, emulate_nodes), layout.devices_per_node
    axes = cfg.mesh.axes()
    if not (_resolves(axes, per_node * nodes) and _resolves(axes, per_node * e)):
        return False
    try:
        fuji.param_specs(cfg.model, cfg.mesh.rules, resolve_axes(axes, per_node * nodes))
    except ValueError:  # a weight dimension that the full job's mesh does not divide
        return False
    shape = resolve_axes(axes, per_node * e)
    shards = 1
    for a in BATCH_AXES:
        shards *= shape.get(a, 1)
    rows = cfg.data.global_batch // nodes * e
    return divisibility_error(rows, cfg.trainer.accum_steps, shards) is None


def scale_table(cfg, nodes: int, node_counts: Sequence[int], **kw) -> list[dict[str, Any]]:
    """Weak scaling: `cfg` at each node count with the per-node batch it has at `nodes`
    (global batch = per-node batch x node count). Counts it cannot be priced at are left out
    (`scale_point_fits`: the mesh or the batch split does not divide); any other error
    surfaces. Rows {nodes, global_batch, step_s_no_overlap, step_s_full_overlap, mfu: [no
    overlap, full overlap], predicted_step_s, predicted_mfu}; one compile at 1 node and one at
    `EMULATE_NODES` serve every count."""
    per_node = cfg.data.global_batch // nodes
    out = []
    for n in node_counts:
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch=per_node * n))
        if not scale_point_fits(c, n, kw["layout"], kw.get("emulate_nodes", EMULATE_NODES)):
            continue
        s = predict(c, nodes=n, **kw)
        out.append(
            {
                "nodes": n,
                "global_batch": per_node * n,
                "step_s_no_overlap": s["step_s_no_overlap"],
                "step_s_full_overlap": s["step_s_full_overlap"],
                "mfu": s["mfu"],
                "predicted_step_s": s["predicted_step_s"],
                "predicted_mfu": s["predicted_mfu"],
                "efa_wire_bytes": s["by_link"].get(platform.LINK_EFA, {}).get("wire_bytes", 0.0),
            }
        )
    return out
