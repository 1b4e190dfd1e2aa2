"""The step-time model of a config on trn2, from compiled programs (`trn-accum dry-run
--step-time`).

For the config and each candidate of `trn_accum.analysis.recommend` (mesh hybrid / reference,
nodes = the config's and 1, k over the values that fit, reduce both ways) this compiles the
real train step (`trn_accum.train.step.build_step`, abstract state and batch) on
`min(nodes, emulate_nodes)` emulated nodes of `layout.devices_per_node` CPU devices each, with
the per-device batch of the real run, prices its collectives on the full mesh
(`trn_accum.analysis.steptime`: the axes' real sizes, the trn2 link of each group) and adds
analytic compute at peak (`step.flops_per_step`, `platform.device_peak_flops`). Two emulated
nodes are enough: a collective's full buffer does not depend on the size of the axes it runs
over, so the groups over "data" (hybrid) or over "fsdp" (reference) are priced at 32 nodes
from a program where they span 2.

Deeper than `max(depths)` layers, each program is compiled at the two `depths` and the
summaries extrapolated per layer (`steptime.extrapolate_summary`, the line of
`trn_accum.analysis.autotune.extrapolate`). Memory fit per candidate is analytic
(`trn_accum.analysis.memory.fit_by_steps`, state sharded on the full mesh).

`run_in_subprocess` runs `explore` in a fresh process with enough emulated devices
(`python -m trn_accum.train.perfmodel`, JSON on stdout): the dry-run's own process has the
devices of one node only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from trn_accum.analysis import recommend as rec
from trn_accum.analysis import steptime
from trn_accum.analysis.memory import GIB, fit_by_steps, state_shard_bytes
from trn_accum.core.sharding import resolve_axes
from trn_accum.errors import UserError
from trn_accum.model import fuji
from trn_accum.neuron import platform
from trn_accum.train import step as step_lib
from trn_accum.train.config import load_config

DEFAULT_DEPTHS = (2, 3)
EMULATE_NODES = 2
_HLO: dict[tuple, tuple[Any, float]] = {}  # program key -> (parsed HLO module, compile s)


def _with(cfg, *, mesh: dict | None = None, k: int | None = None, reduce: str | None = None,
          layers: int | None = None):  # fmt: skip
    """cfg with mesh sizes / accum_steps / reduce / num_layers replaced."""
    m = cfg.mesh if mesh is None else dataclasses.replace(cfg.mesh, **mesh)
    t = dataclasses.replace(
        cfg.trainer,
        accum_steps=cfg.trainer.accum_steps if k is None else k,
        reduce=cfg.trainer.reduce if reduce is None else reduce,
    )
    mo = cfg.model if layers is None else dataclasses.replace(cfg.model, num_layers=layers)
    return dataclasses.replace(cfg, mesh=m, trainer=t, model=mo)


def _compiled_module(cfg, devices, rows: int):
    """(parsed HLO, compile seconds) of the train step of `cfg` on `devices`, cached."""
    from trn_accum.analysis.hlo import parse_hlo

    shape = resolve_axes(cfg.mesh.axes(), len(devices))
    key = (plain_attention(_with(cfg, mesh=shape)), len(devices), rows)
    if key not in _HLO:
        t0 = time.perf_counter()
        mesh = step_lib.make_mesh(key[0], devices)
        text = step_lib.build_step(key[0], mesh, batch_rows=rows).compiled.as_text()
        _HLO[key] = (parse_hlo(text), time.perf_counter() - t0)
    return _HLO[key]


def _state_bytes(cfg, target_shape: dict) -> int:
    """Per-device params + optimizer state + two float32 gradients (accumulator and one
    minibatch's) on the full mesh."""
    tx, _ = step_lib.make_optimizer(cfg)
    abstract = step_lib.abstract_state(cfg, tx)
    specs = fuji.param_specs(cfg.model, cfg.mesh.rules, target_shape)
    sspecs = step_lib.state_specs(tx, abstract, specs)
    b = state_shard_bytes(abstract, specs, sspecs["opt_state"], target_shape)
    return b["params"] + b["opt_state"] + 2 * b["grads"]


def predict(cfg, *, nodes: int, layout: steptime.Layout, devices=None,
            emulate_nodes: int = EMULATE_NODES, depths=DEFAULT_DEPTHS) -> dict:  # fmt: skip
    """The step-time summary of `cfg` (integer accum_steps) on `nodes` nodes, with
    "depths_compiled" and "compile_s"."""
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
    peak = platform.device_peak_flops() * per_node * nodes
    layers = cfg.model.num_layers
    at = sorted(depths) if layers > max(depths) else [layers]
    by_depth, secs = {}, 0.0
    for d in at:
        module, s = _compiled_module(_with(cfg, layers=d), devs, rows)
        secs += s
        costs = steptime.collective_costs(module, compiled_shape, target, layout)
        by_depth[d] = steptime.summarize(
            costs, flops_per_step=fl["total"], peak_flops=peak, tokens_per_step=fl["tokens"],
            accum_steps=k,
        )  # fmt: skip
    out = by_depth[layers] if len(at) == 1 else steptime.extrapolate_summary(by_depth, layers)
    return {**out, "depths_compiled": at, "compile_s": round(secs, 2), "target_mesh": target}


def fitting_k(cfg, mesh_axes: dict, nodes: int, layout: steptime.Layout) -> dict[str, Any]:
    """`fit_by_steps` of `cfg` on `mesh_axes` at `nodes` nodes (analytic, budget =
    trainer.memory_budget_gib)."""
    c = _with(cfg, mesh=mesh_axes)
    target = resolve_axes(mesh_axes, layout.devices_per_node * nodes)
    per_node = resolve_axes(mesh_axes, layout.devices_per_node)
    budget = cfg.trainer.memory_budget_gib * GIB
    return fit_by_steps(c, per_node, _state_bytes(c, target), nodes, budget)


def explore(cfg, *, nodes: int, layout: steptime.Layout, devices=None,
            meshes=None, k_limit: int = 3, depths=DEFAULT_DEPTHS,
            emulate_nodes: int = EMULATE_NODES,
            memory_scale: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """The config's prediction, every candidate's (fit, summary) and the recommendation.

    A candidate fits when its analytic per-device bytes times `memory_scale` are within
    trainer.memory_budget_gib. The dry-run passes its own measured scale: the config's compiled
    (XLA:CPU) footprint over its analytic total, when larger than 1, so a candidate is only
    recommended where the compiled program, not just the lower-bound estimate, would fit."""
    t0 = time.perf_counter()
    meshes = rec.MESHES if meshes is None else meshes
    kw = dict(layout=layout, devices=devices, depths=depths, emulate_nodes=emulate_nodes)
    node_counts = sorted({nodes, 1})
    fits = {(m, n): fitting_k(cfg, axes, n, layout) for m, axes in meshes.items()
            for n in node_counts}  # fmt: skip
    budget = cfg.trainer.memory_budget_gib * GIB
    fit_ks = {key: [r["k"] for r in f["table"] if r["bytes"] * memory_scale <= budget]
              for key, f in fits.items()}  # fmt: skip
    rows, seen = [], set()
    for cand in rec.candidate_grid(fit_ks, k_limit=k_limit):
        target = resolve_axes(meshes[cand.mesh], layout.devices_per_node * cand.nodes)
        # once = per_minibatch without a data axis to reduce over (core/reduce_once.py); at one
        # node the meshes may coincide: each program once
        effective = cand.reduce if target["data"] > 1 else "per_minibatch"
        same = (tuple(target.items()), cand.k, effective)
        if same in seen:
            continue
        seen.add(same)
        c = _with(cfg, mesh=meshes[cand.mesh], k=cand.k, reduce=cand.reduce)
        summary = predict(c, nodes=cand.nodes, **kw)
        rows.append({"candidate": cand, "fits": True, "summary": summary})
    own = predict(cfg, nodes=nodes, **kw)
    best = rec.recommend(rows, nodes)
    return {
        "config": {
            "mesh": cfg.mesh.axes(),
            "nodes": nodes,
            "k": cfg.trainer.accum_steps,
            "reduce": cfg.trainer.reduce,
            "summary": own,
        },  # fmt: skip
        "fit_k": {f"{m} x{n}": ks for (m, n), ks in fit_ks.items()},
        "memory_scale": memory_scale,
        "candidates": [{**r, "candidate": dataclasses.asdict(r["candidate"])} for r in rows],
        "table": rec.format_rows(rows),
        "recommendation": best,
        "layout": dataclasses.asdict(layout),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


class StepTimeError(UserError):
    """The step-time model could not compile or price the config (e.g. a mesh or batch that
    the trn2 candidate meshes do not divide); the dry-run reports it and goes on."""


def plain_attention(cfg):
    """cfg with attention "plain": the attention core of every kind is local to a device's
    (rows, heads) shard, so the collectives are the same; plain compiles fastest, and
    "neuron_flash" has no CPU kernel."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="plain"))


def run_in_subprocess(
    config_path: str, overrides: Sequence[str], nodes: int, memory_scale: float = 1.0
) -> dict[str, Any]:
    """`explore` of the config on trn2 in a fresh process with enough emulated CPU devices."""
    n = platform.devices_per_node() * min(nodes, EMULATE_NODES)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={n} "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    ).strip()
    cmd = [sys.executable, "-m", "trn_accum.train.perfmodel", "--config", config_path,
           "--nodes", str(nodes), "--memory-scale", repr(float(memory_scale))] + [
        a for o in overrides for a in ("--set", o)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit {out.returncode}"
        raise StepTimeError(f"the step-time model could not price this config: {last}")
    return json.loads(out.stdout)


def format_lines(st: dict[str, Any]) -> list[str]:
    """The step-time part of the dry-run report (`explore`'s output, as JSON-decoded)."""
    from trn_accum.analysis.autotune import format_bytes

    c, s = st["config"], st["config"]["summary"]
    depths = s["depths_compiled"]
    how = f"compiled at {depths[0]} and {depths[1]} layers, extrapolated" if len(depths) == 2 else (
        f"compiled at {depths[0]} layers")  # fmt: skip
    lines = [
        f"step-time model on trn2 (collectives of the compiled step, {how}; "
        f"{min(c['nodes'], EMULATE_NODES)} emulated nodes priced as {c['nodes']}, full mesh "
        f"{s['target_mesh']}; ring algorithms, links in trn_accum/neuron/platform.py):",
        f"  config: mesh {c['mesh']}, k={c['k']}, reduce {c['reduce']}",
        f"  {'link':<6} {'bytes/device/step':>18} {'time s':>9} {'ops':>4}",
    ]
    for link, row in s["by_link"].items():
        lines.append(
            f"  {link:<6} {format_bytes(row['wire_bytes']):>18} {row['time_s']:>9.3f} "
            f"{int(row['count']):>4}"
        )
    for axes, row in s["by_axes"].items():
        lines.append(
            f"  over {axes}: {format_bytes(row['wire_bytes'])} per step, "
            f"{format_bytes(row['loop_wire_bytes_per_minibatch'])} per minibatch in the loop"
        )
    lines += [
        f"  compute at peak {s['compute_s']:.3f} s, communication {s['comm_s']:.3f} s; step "
        f"{s['step_s_full_overlap']:.3f} s (full overlap) to {s['step_s_no_overlap']:.3f} s (none)"
        f"; tokens/s {s['tokens_per_s'][0]:.4g}-{s['tokens_per_s'][1]:.4g}; MFU "
        f"{s['mfu'][0]:.1%}-{s['mfu'][1]:.1%}",
        "  candidates (k that fit the budget: analytic bytes x "
        f"{st.get('memory_scale', 1.0):.2f}, the dry-run's compiled CPU footprint over its "
        "analytic total; "
        + "; ".join(f"{key}: {ks}" for key, ks in st["fit_k"].items())
        + "); bytes per device per step:",
        *st["table"],
    ]
    best = st.get("recommendation")
    if best:
        lines.append(f"  recommended at {c['nodes']} node(s): {best['label']}")
        lines += [f"    - {r}" for r in best["reasons"]]
    lines.append(f"  step-time model wall time {st['wall_s']} s")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trn_accum.train.perfmodel")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--memory-scale", type=float, default=1.0)
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    nodes = cfg.mesh.nodes if a.nodes is None else a.nodes
    if not isinstance(cfg.trainer.accum_steps, int):
        fits = fitting_k(cfg, cfg.mesh.axes(), nodes, steptime.Layout.trn2())["accum_steps"]
        cfg = _with(cfg, k=fits or 1)
    report = explore(cfg, nodes=nodes, layout=steptime.Layout.trn2(), memory_scale=a.memory_scale)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
