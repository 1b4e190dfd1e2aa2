"""`trn-accum dry-run`: compile the real train step for one trn2.48xlarge on emulated CPU devices.

The process must already run N CPU devices (`trn_accum.cli` arranges it before JAX starts).
The mesh is the config's on those N devices (one trn2.48xlarge = 64 logical cores at LNC=2);
the batch is the rows one node carries when the config's global batch is spread over `nodes`
nodes (`--nodes`, default `mesh.nodes`), so every device sees the per-device batch of the real
run. The state is abstract (`jax.eval_shape`), inputs are `ShapeDtypeStruct`s with the real
shardings: no memory for parameters. The report:

- parameter count; exact per-device bytes of parameters, gradients (the float32 accumulator)
  and optimizer state, from each leaf's shard shape on the full multi-node mesh;
- compiled `memory_analysis()` (arguments, outputs, temporaries) with the CPU caveats, next to
  an analytic activation estimate, and whether each fits the per-device budget (24 GiB per
  trn2 logical core): a report, not a blocker;
- FLOPs per step: analytic 6·N·tokens + causal attention, and `cost_analysis()` corrected for
  loop trip counts (XLA counts a while body once: the dot FLOPs of each loop computation, read
  from the compiled HLO, are added trip_count - 1 more times);
- the step-time floor (analytic FLOPs at peak) and the MFU formula for the node count;
- the collectives of `split_minibatches` compiled alone with the real input sharding (must be
  0, else a blocker), and the collectives of the whole step (inside / outside loops);
- the Neuron preflight of the compiled step (`trn_accum.neuron.preflight`): blockers make the
  command exit non-zero, warnings are listed.

`attention = "neuron_flash"` has no CPU kernel: the dry-run compiles "blockwise" (same memory
behaviour: no score matrices) and says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trn_accum import hlo as hlo_lib
from trn_accum import train
from trn_accum.config import Config, load_config
from trn_accum.model import fuji
from trn_accum.sharding import split_minibatches

GIB = 1024**3
TRN2_DEVICE_BUDGET_GIB = 24.0  # HBM per logical core at LNC=2 (FACTS.md §2)
TRN2_PEAK_PER_CHIP = 667e12  # dense BF16 FLOP/s per trn2 chip
TRN2_CHIPS_PER_NODE = 16


class DryRunError(ValueError):
    """A user-caused dry-run problem (node count vs batch, ...): one line."""


# ---------------------------------------------------------------------------------------------
# Pure helpers


def resolve_axes(axes: Mapping[str, int], devices: int) -> dict[str, int]:
    """Mesh axis sizes with the -1 resolved over `devices` (no Mesh built)."""
    fixed = math.prod(s for s in axes.values() if s != -1)
    return {a: (devices // fixed if s == -1 else s) for a, s in axes.items()}


def _spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def shard_bytes(shape: Sequence[int], dtype, spec: P, mesh_shape: Mapping[str, int]) -> int:
    """Bytes of one device's shard of an array of `shape` under `spec` on a mesh of that shape
    (a dimension not divisible by its axes is padded, as XLA does)."""
    dims = []
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    for d, entry in zip(shape, entries, strict=True):
        n = math.prod(mesh_shape.get(a, 1) for a in _spec_axes(entry))
        dims.append(-(-d // n))
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def tree_shard_bytes(abstract, specs, mesh_shape: Mapping[str, int]) -> int:
    leaves = jax.tree.leaves(abstract)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(
        shard_bytes(a.shape, a.dtype, s, mesh_shape)
        for a, s in zip(leaves, spec_leaves, strict=True)
    )


def activation_estimate(cfg: Config, rows_per_minibatch: int, model_axis: int) -> dict[str, Any]:
    """Analytic per-device activation bytes of one minibatch (forward kept for backward).

    t = rows per device group per minibatch x seq tokens (replicated over the `model` axis;
    heads and FFN hidden split over it), c = compute bytes. Saved per layer: remat "full":
    the layer input (t·D·c); "save_qkvo": + q, k, v, context (t·(2H+2KV)·Dh/m·c) + o projection
    (t·D·c); "none": everything a layer makes (+ norms, FFN gate/up/act, attention scores when
    plain). Plus the working set of one layer recomputed in backward, the logits (float32,
    vocabulary split over `model`; one chunk when loss_chunk > 0) and the all-gathered bf16
    weights of one layer and of the embedding (FSDP).
    """
    m = cfg.model
    mp = max(1, model_axis)
    c = jnp.dtype(m.compute_dtype).itemsize
    s = cfg.data.seq_len
    t = rows_per_minibatch * s
    d, h, kv, dh, f, v = (
        m.hidden_dim,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.ffn_dim,
        m.vocab_size,
    )
    qkvc = t * (2 * h + 2 * kv) * dh // mp * c
    if m.attention == "plain":
        scores = rows_per_minibatch * (h // mp) * s * s * 4 * 2  # scores + probs, float32
    else:
        blk = min(m.attention_block, s)
        scores = rows_per_minibatch * (h // mp) * s * blk * 4 * 2
    full_layer = t * c * (5 * d) + qkvc + t * c * 3 * f // mp + scores
    per_layer = {
        "full": t * d * c,
        "save_qkvo": t * d * c + qkvc + t * d * c,
        "none": full_layer,
    }[m.remat]
    logit_tokens = t if m.loss_chunk <= 0 else min(t, m.loss_chunk)
    logits = logit_tokens * (v // mp) * 4 * 2  # logits and their gradient, float32
    layer_weights = (d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f) // mp * c
    gathered = 2 * layer_weights + v * d // mp * c
    saved = per_layer * m.num_layers
    total = saved + full_layer + logits + gathered
    return {
        "tokens_per_device": t,
        "saved_per_layer": per_layer,
        "saved_all_layers": saved,
        "one_layer_recompute": full_layer,
        "logits": logits,
        "gathered_weights": gathered,
        "total": total,
    }


def fit_by_steps(
    cfg: Config, mesh_per_node: Mapping[str, int], fixed_bytes: int, nodes: int, budget: float
) -> dict[str, Any]:
    """Analytic per-device bytes for every valid accum_steps k at `nodes` nodes, and the
    smallest k that fits `budget` (None if none does).

    fixed_bytes: what does not depend on k (parameters, optimizer state, the float32
    accumulator and one minibatch's gradient). Per-device state is the same for any node count
    (nodes replicate over `data`); only the rows per device group change:
    global_batch / nodes / (data x fsdp per node)."""
    groups = mesh_per_node.get("data", 1) * mesh_per_node.get("fsdp", 1)
    b = cfg.data.global_batch
    if b % nodes or (b // nodes) % groups:
        return {"nodes": nodes, "rows_per_group": None, "table": [], "accum_steps": None}
    rows = b // nodes // groups
    table = []
    for k in (j for j in range(1, rows + 1) if rows % j == 0):
        act = activation_estimate(cfg, rows // k, mesh_per_node.get("model", 1))
        table.append({"k": k, "rows_per_minibatch": rows // k, "bytes": fixed_bytes + act["total"]})
    fits = [row["k"] for row in table if row["bytes"] <= budget]
    return {
        "nodes": nodes,
        "rows_per_group": rows,
        "table": table,
        "accum_steps": min(fits, default=None),
    }


def hlo_dot_flops(module: hlo_lib.HloModule) -> dict[str, Any]:
    """Dot FLOPs per device from a compiled module: once each (`once`) and multiplied by the
    trip counts of the loops they sit in (`with_trips`); `unknown_trips` counts dots in loops
    of unknown trip count (taken once)."""
    once = with_trips = 0
    unknown = 0
    for ins in module.instructions():
        if ins.opcode != "dot" or not ins.shapes:
            continue
        ops = module.operand_instructions(ins)
        if not ops or not ops[0].shapes:
            continue
        lhs = ops[0].shapes[0].dims
        contracting = [
            int(x) for x in re.findall(r"\d+", ins.attrs.get("lhs_contracting_dims", ""))
        ]
        k = math.prod(lhs[i] for i in contracting if i < len(lhs))
        flops = 2 * ins.shapes[0].size * k
        mult = module.trip_multiplier(ins.computation)
        once += flops
        if mult is None:
            unknown += 1
            mult = 1
        with_trips += flops * mult
    return {"once": once, "with_trips": with_trips, "unknown_trips": unknown}


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - backend without cost analysis
        return None
    if isinstance(cost, Sequence) and cost:
        cost = cost[0]
    if not isinstance(cost, Mapping) or "flops" not in cost:
        return None
    return float(cost["flops"])


def _memory(compiled) -> dict[str, int] | None:
    try:
        mem = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if mem is None:
        return None
    keys = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {k.removesuffix("_size_in_bytes"): int(getattr(mem, k, 0) or 0) for k in keys}


def _findings(hlo_text: str) -> tuple[list[str], list[str]]:
    """(blockers, warnings) of `trn_accum.neuron.preflight` as one-line strings; the PRNG is
    taken as rbg, what a trn2 run configures (`trn_accum.distributed.initialize`)."""
    from trn_accum import neuron  # noqa: PLC0415

    blockers, warnings = [], []
    for f in neuron.preflight(hlo_text, prng_impl="rbg"):
        text = " ".join(str(f).split())
        (blockers if f.severity == neuron.BLOCKER else warnings).append(text)
    return blockers, warnings


# ---------------------------------------------------------------------------------------------
# The dry-run


def run(
    config_path: str,
    *,
    overrides: Sequence[str] = (),
    devices: int | None = None,
    nodes: int | None = None,
) -> dict[str, Any]:
    """Lower and compile the train step; returns the report (see the module docstring)."""
    t_start = time.perf_counter()
    cfg = load_config(config_path, overrides)
    notes: list[str] = []
    if cfg.model.attention == "neuron_flash":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="blockwise"))
        notes.append(
            'attention "neuron_flash" has no CPU kernel: compiled with "blockwise" (no score '
            "matrices either), so memory figures match a flash kernel's, not plain attention's"
        )
    devs = jax.devices()
    n_dev = len(devs) if devices is None else devices
    if n_dev != len(devs):
        raise DryRunError(
            f"--devices {n_dev}: this process has {len(devs)} devices; run through "
            f"`trn-accum dry-run`, which sets the emulated device count"
        )
    nodes = cfg.mesh.nodes if nodes is None else int(nodes)
    if nodes < 1 or cfg.data.global_batch % nodes:
        raise DryRunError(
            f"--nodes {nodes}: data.global_batch = {cfg.data.global_batch} must split evenly "
            f"over the nodes (rows per node = global_batch / nodes); pick a divisor"
        )
    node_batch = cfg.data.global_batch // nodes
    mesh = train.make_mesh(cfg, devs)
    tuned = None
    if cfg.trainer.accum_steps == "auto":
        cfg, tuned = _autotune(cfg, mesh, node_batch)
    k = train.check_batch(cfg, mesh, node_batch)
    local_shape = dict(mesh.shape)
    full_shape = resolve_axes(cfg.mesh.axes(), n_dev * nodes)
    if full_shape["data"] * full_shape["fsdp"] * full_shape["model"] != n_dev * nodes:
        raise DryRunError(
            f"mesh {cfg.mesh.axes()} does not fit {nodes} nodes x {n_dev} devices: set one axis "
            f"to -1"
        )
    rows_per_group = node_batch // (local_shape["data"] * local_shape["fsdp"])
    rows_per_mb = rows_per_group // k

    tx, lr_fn = train.make_optimizer(cfg)
    specs = train.param_specs(cfg, mesh)
    abstract = train.abstract_state(cfg, tx)
    sspecs = train.state_specs(tx, abstract, specs)
    shardings = train.named(mesh, sspecs)
    step_fn = train.make_train_step(cfg, mesh, tx, lr_fn, specs, shardings)
    state_in = train.restore_target(abstract, shardings)
    batch_in = train.abstract_batch(cfg, mesh, node_batch)

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = step_fn.lower(state_in, batch_in)
        t1 = time.perf_counter()
        compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo_text = compiled.as_text()
    module = hlo_lib.parse_hlo(hlo_text)

    # The split alone, with the real input sharding: must move nothing.
    split = jax.jit(
        lambda b: split_minibatches(b, k, mesh=mesh, batch_spec=train.BATCH_SPEC),
        in_shardings=(train.batch_sharding(mesh),),
    )
    with jax.set_mesh(mesh):
        split_hlo = split.lower(batch_in).compile().as_text()
    split_counts = hlo_lib.count_collectives(split_hlo)["total"]
    step_counts = module.count_collectives()

    # Bytes per device, exact from shard shapes on the full (multi-node) mesh.
    n_params = fuji.num_params(cfg.model)
    p_bytes = tree_shard_bytes(abstract["params"], specs, full_shape)
    g_bytes = tree_shard_bytes(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), abstract["params"]),
        specs,
        full_shape,
    )
    o_bytes = tree_shard_bytes(abstract["opt_state"], sspecs["opt_state"], full_shape)
    mem = _memory(compiled)
    act = activation_estimate(cfg, rows_per_mb, local_shape.get("model", 1))
    budget = TRN2_DEVICE_BUDGET_GIB * GIB
    state_bytes = p_bytes + g_bytes + o_bytes
    analytic_total = state_bytes + g_bytes + act["total"]  # + one minibatch's gradient
    fit_nodes = sorted({1, cfg.mesh.nodes, nodes})
    fit_table = [
        fit_by_steps(cfg, local_shape, state_bytes + g_bytes, n, budget) for n in fit_nodes
    ]

    # FLOPs.
    fl = train.flops_per_step(cfg)  # the full global batch (all nodes)
    total_devices = n_dev * nodes
    cost = _cost_flops(compiled)
    dots = hlo_dot_flops(module)
    cost_trips = None if cost is None else cost + dots["with_trips"] - dots["once"]
    chips = TRN2_CHIPS_PER_NODE * nodes * n_dev / 64
    peak_total = TRN2_PEAK_PER_CHIP * chips
    floor_s = fl["total"] / peak_total

    blockers, warnings = _findings(hlo_text)
    if sum(split_counts.values()):
        blockers.append(f"blocker: split: split_minibatches compiled to collectives {split_counts}")

    return {
        "config": config_path,
        "overrides": list(overrides),
        "notes": notes,
        "devices": n_dev,
        "nodes": nodes,
        "mesh_per_node": local_shape,
        "mesh_all_nodes": full_shape,
        "global_batch": cfg.data.global_batch,
        "seq_len": cfg.data.seq_len,
        "rows_per_node": node_batch,
        "accum_steps": k,
        "autotune": None if tuned is None else {**tuned.to_dict(), "text": tuned.format()},
        "rows_per_device_group_per_minibatch": rows_per_mb,
        "layers": cfg.model.num_layers,
        "layer_loop": cfg.model.layer_loop,
        "accum_loop": cfg.trainer.loop,
        "attention": cfg.model.attention,
        "remat": cfg.model.remat,
        "params": n_params,
        "bytes_per_device": {
            "params": p_bytes,
            "grads": g_bytes,
            "opt_state": o_bytes,
            "state_total": state_bytes,
        },
        "compiled_memory_per_device": mem,
        "compiled_memory_caveat": (
            "XLA:CPU temporaries are a proxy, not a trn2 fit check: CPU computes bf16 dots in "
            "float32 and schedules differently; unrolled layers may keep more than remat "
            "implies (FACTS.md §7)"
        ),
        "activation_estimate": act,
        "fit": {
            "budget_gib": TRN2_DEVICE_BUDGET_GIB,
            "analytic_total_bytes": analytic_total,
            "analytic_fits": analytic_total <= budget,
            "compiled_total_bytes": None
            if mem is None
            else mem["argument"] + mem["output"] - mem["alias"] + mem["temp"],
            "compiled_fits": None
            if mem is None
            else mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] <= budget,
        },
        "fit_by_accum_steps": fit_table,
        "flops": {
            "analytic_per_step": fl["total"],
            "analytic_dense_6NT": fl["dense"],
            "analytic_attention": fl["attention"],
            "tokens_per_step": fl["tokens"],
            "analytic_per_device": fl["total"] / total_devices,
            "cost_analysis_per_device": cost,
            "hlo_dot_flops_once": dots["once"],
            "hlo_dot_flops_with_trips": dots["with_trips"],
            "cost_analysis_with_trips_per_device": cost_trips,
            "cost_analysis_with_trips_all_devices": None
            if cost_trips is None
            else cost_trips * total_devices,
        },
        "step_time_floor_s": floor_s,
        "mfu_formula": (
            f"MFU = {fl['total']:.4g} FLOP / step_time_s / ({TRN2_PEAK_PER_CHIP:.4g} FLOP/s x "
            f"{chips:g} chips) = {floor_s:.4g} s / step_time_s"
        ),
        "split_collectives": split_counts,
        "step_collectives": {
            "outside_loops": step_counts["outside_loops"],
            "inside_loops": step_counts["inside_loops"],
        },
        "blockers": blockers,
        "warnings": warnings,
        "timings_s": {
            "lower": round(t1 - t0, 2),
            "compile": round(t2 - t1, 2),
            "total": round(time.perf_counter() - t_start, 2),
        },
    }


def _autotune(cfg: Config, mesh, node_batch: int):
    """accum_steps = "auto": the smallest k whose compiled step fits trainer.memory_budget_gib
    per device, for one node's rows on this node's mesh (`trn_accum.autotune`)."""
    from trn_accum import autotune  # noqa: PLC0415

    try:
        return autotune.resolve_accum_steps(cfg, mesh, batch_rows=node_batch)
    except autotune.AutotuneError as e:
        raise DryRunError(str(e)) from None


def _gib(x: float | None) -> str:
    """Bytes in GiB (or MiB / KiB when small)."""
    if x is None:
        return "n/a"
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(x) >= 0.1 * scale:
            return f"{x / scale:.2f} {unit}"
    return f"{int(x)} B"


def _nonzero(counts: Mapping[str, int]) -> str:
    shown = {k: v for k, v in counts.items() if v}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) if shown else "none"


def format_report(r: Mapping[str, Any], *, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(r, indent=2, default=str)
    b, f, fit, a = r["bytes_per_device"], r["flops"], r["fit"], r["activation_estimate"]
    mem = r["compiled_memory_per_device"]
    lines = [f"dry-run of {r['config']} {' '.join('--set ' + o for o in r['overrides'])}".strip()]
    lines += [f"note: {n}" for n in r["notes"]]
    lines += [
        f"devices {r['devices']} per node (emulated on CPU), nodes {r['nodes']}; mesh per node "
        f"{r['mesh_per_node']}, all nodes {r['mesh_all_nodes']}",
        f"batch {r['global_batch']} x {r['seq_len']}: {r['rows_per_node']} rows per node, "
        f"{r['accum_steps']} minibatches ({r['accum_loop']}), "
        f"{r['rows_per_device_group_per_minibatch']} rows per device group per minibatch",
        *(r["autotune"]["text"].splitlines() if r.get("autotune") else []),
        f"model: {r['layers']} layers ({r['layer_loop']}), attention {r['attention']}, "
        f"remat {r['remat']}",
        f"parameters: {r['params']:,}",
        f"per device: params {_gib(b['params'])}, grads {_gib(b['grads'])}, optimizer state "
        f"{_gib(b['opt_state'])} (total {_gib(b['state_total'])}; exact shard sizes)",
    ]
    if mem:
        lines.append(
            f"compiled (XLA:CPU): arguments {_gib(mem['argument'])}, outputs "
            f"{_gib(mem['output'])}, aliased {_gib(mem['alias'])}, temporaries {_gib(mem['temp'])}"
        )
    lines += [
        f"  caveat: {r['compiled_memory_caveat']}",
        f"analytic activations per device: {_gib(a['total'])} (saved {_gib(a['saved_all_layers'])}"
        f", one layer recomputed {_gib(a['one_layer_recompute'])}, logits {_gib(a['logits'])}, "
        f"gathered weights {_gib(a['gathered_weights'])})",
        f"fits {fit['budget_gib']:g} GiB per device: analytic "
        f"{_gib(fit['analytic_total_bytes'])} -> {'yes' if fit['analytic_fits'] else 'NO'}; "
        f"compiled CPU {_gib(fit['compiled_total_bytes'])} -> "
        f"{'yes' if fit['compiled_fits'] else 'NO'} (report only)",
    ]
    for ft in r.get("fit_by_accum_steps", []):
        if not ft["table"]:
            continue
        need = ft["accum_steps"]
        cells = ", ".join(
            f"k={row['k']}: {_gib(row['bytes'])}" for row in ft["table"] if row["k"] <= 256
        )
        lines.append(
            f"analytic per device at {ft['nodes']} node(s) ({ft['rows_per_group']} rows per device "
            f"group): {cells}; fits {fit['budget_gib']:g} GiB from k="
            f"{need if need is not None else 'none'}"
        )
    lines += [
        f"FLOPs per step: analytic {f['analytic_per_step']:.4g} (6NT {f['analytic_dense_6NT']:.4g}"
        f" + attention {f['analytic_attention']:.4g}), {f['analytic_per_device']:.4g} per device",
        f"  cost_analysis per device {f['cost_analysis_per_device'] or 0:.4g} (loop bodies once);"
        f" with trip counts {f['cost_analysis_with_trips_per_device'] or 0:.4g}",
        f"step-time floor at trn2 peak: {r['step_time_floor_s']:.4g} s; {r['mfu_formula']}",
        f"split_minibatches collectives: {sum(r['split_collectives'].values())} "
        f"{_nonzero(r['split_collectives'])}",
        f"train step collectives: outside loops {_nonzero(r['step_collectives']['outside_loops'])}"
        f", inside loops (per iteration) {_nonzero(r['step_collectives']['inside_loops'])}",
        f"Neuron preflight: {len(r['blockers'])} blockers, {len(r['warnings'])} warnings",
    ]
    lines += [f"  - {x}" for x in r["blockers"] + r["warnings"]]
    t = r["timings_s"]
    lines.append(f"lower {t['lower']} s, compile {t['compile']} s, total {t['total']} s")
    return "\n".join(lines)
