"""The dry-run's report as the text `trn-accum dry-run` prints (or as JSON): config and
substitutions, mesh and batch, bytes per device, fit, FLOPs, collectives, preflight findings,
timings and the step-time model's lines (`trn_accum.plan.steptime_report`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trn_accum.analysis.memory import GIB
from trn_accum.neuron import platform
from trn_accum.plan import steptime_report

# Bytes per logit per device while one loss chunk is live: its float32 logits (4) and their
# float32 gradient (4), and the compute-dtype copy the LM head's backward reads (2).
LOGIT_BYTES = 10


def loss_chunk_report(cfg, model_axis: int, rows_per_minibatch: int) -> dict[str, Any]:
    """The loss chunk a resolved `cfg` uses, per batch shard: {"loss_chunk" (the setting),
    "tokens_per_chunk", "chunks_per_minibatch", "logit_bytes_per_device" (one chunk's logits at
    LOGIT_BYTES each, the vocabulary split over the model axis)}. rows_per_minibatch: rows per
    batch shard (device group) per minibatch."""
    whole = rows_per_minibatch * cfg.data.seq_len
    chunk = cfg.model.loss_chunk
    tokens = min(chunk, whole) if chunk else whole
    per_token = cfg.model.vocab_size / max(1, model_axis) * LOGIT_BYTES
    return {
        "loss_chunk": chunk,
        "tokens_per_chunk": tokens,
        "chunks_per_minibatch": -(-whole // tokens),
        "logit_bytes_per_device": int(tokens * per_token),
    }


def peak_note(floor_s: float) -> str:
    """The other published peak (the NeuronCore-v3 page's per-core figure x 8) next to ours."""
    alt = platform.TRN2_CORE_PEAK_FLOPS_ALT * platform.TRN2_CORES_PER_CHIP
    return (
        f"peak: {platform.TRN2_CHIP_PEAK_FLOPS / 1e12:g} TFLOP/s per chip (Trainium2 page); the "
        f"NeuronCore-v3 page's {platform.TRN2_CORE_PEAK_FLOPS_ALT / 1e12:g} x "
        f"{platform.TRN2_CORES_PER_CHIP} = {alt / 1e12:g} per chip would put the floor at "
        f"{floor_s * platform.TRN2_CHIP_PEAK_FLOPS / alt:.4g} s"
    )


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
    """The dry-run report `r` (`trn_accum.plan.dryrun.run`) as lines of text, or as JSON."""
    if as_json:
        return json.dumps(r, indent=2, default=str)
    b, f, fit, a = r["bytes_per_device"], r["flops"], r["fit"], r["activation_estimate"]
    mem = r["compiled_memory_per_device"]
    lines = [f"dry-run of {r['config']} {' '.join('--set ' + o for o in r['overrides'])}".strip()]
    lines += [f"note: {n}" for n in r["notes"]]
    subs = r.get("substitutions", [])
    lines += [f"substituted: {x['piece']} -> {x['with']} ({x['why']})" for x in subs]
    lines += [] if subs else ["substituted: nothing (every piece compiles as it will on trn2)"]
    lines += [
        f"devices {r['devices']} per node (emulated on CPU), nodes {r['nodes']}; mesh per node "
        f"{r['mesh_per_node']}, all nodes {r['mesh_all_nodes']}",
        f"batch {r['global_batch']} x {r['seq_len']}: {r['rows_per_node']} rows per node, "
        f"{r['accum_steps']} minibatch{'' if r['accum_steps'] == 1 else 'es'} "
        f"({r['accum_loop']}), "
        f"{r['rows_per_device_group_per_minibatch']} rows per device group per minibatch",
        *r["train_will_run"]["text"].splitlines(),
        f"model: {r['layers']} layers ({r['layer_loop']}), attention {r['attention']}, "
        f"remat {r['remat']}, loss chunk {r['loss']['tokens_per_chunk']} tokens per batch shard "
        f"({r['loss']['chunks_per_minibatch']} per minibatch, logits "
        f"{r['loss']['logit_bytes_per_device'] / 2**30:.2f} GiB per device)",
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
        f"compiled {_gib(fit['compiled_total_bytes'])} -> "
        f"{'yes' if fit['compiled_fits'] else 'NO'} ({fit['compiled_source']}; XLA:CPU's "
        f"{_gib(fit['xla_cpu_total_bytes'])})",
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
        f"step-time floor at {r.get('platform', 'trn2')} peak: {r['step_time_floor_s']:.4g} s; "
        f"{r['mfu_formula']}",
        f"  {r['peak_note']}",
        f"split_minibatches collectives: {sum(r['split_collectives'].values())} "
        f"{_nonzero(r['split_collectives'])}",
        f"train step collectives: outside loops {_nonzero(r['step_collectives']['outside_loops'])}"
        f", inside loops (per iteration) {_nonzero(r['step_collectives']['inside_loops'])}",
        f"Neuron preflight: {len(r['blockers'])} blockers, {len(r['warnings'])} warnings",
    ]
    lines += [f"  - {x}" for x in r["blockers"] + r["warnings"]]
    t = r["timings_s"]
    lines.append(f"lower {t['lower']} s, compile {t['compile']} s, total {t['total']} s")
    if r.get("step_time", {}).get("error"):
        lines.append(f"step-time model: not computed: {r['step_time']['error']}")
    elif r.get("step_time"):
        lines += steptime_report.format_lines(r["step_time"])
    return "\n".join(lines)
