"""The step-time part of the dry-run report: `format_lines` of `trn_accum.plan.perfmodel.explore`'s
output (as JSON-decoded), the floor and the prediction side by side."""

from __future__ import annotations

from typing import Any

from trn_accum.plan.perfmodel import EMULATE_NODES


def format_lines(st: dict[str, Any]) -> list[str]:
    """The step-time part of the dry-run report (`explore`'s output, as JSON-decoded)."""
    from trn_accum.analysis.memory import format_bytes

    c, s = st["config"], st["config"]["summary"]
    depths = s["depths_compiled"]
    how = (
        f"compiled at {depths[0]} and {depths[1]} layers, extrapolated"
        if len(depths) == 2
        else (f"compiled at {depths[0]} layers")
    )
    lines = [
        f"step-time model on {st.get('platform', 'trn2')} (collectives of the compiled step, "
        f"{how}; "
        f"{min(c['nodes'], EMULATE_NODES)} emulated nodes priced as {c['nodes']}, full mesh "
        f"{s['target_mesh']}; hierarchical ring algorithms, links in "
        "trn_accum/neuron/platform.py):",
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
        f"  compute: {s['flops_executed_per_step']:.4g} FLOP executed (HLO dots x trips) of "
        f"{s['flops_per_step']:.4g} useful, at peak {s['compute_s']:.3f} s; communication "
        f"{s['comm_s']:.3f} s; step {s['step_s_full_overlap']:.3f} s (full overlap) to "
        f"{s['step_s_no_overlap']:.3f} s (none); tokens/s {s['tokens_per_s'][0]:.4g}-"
        f"{s['tokens_per_s'][1]:.4g}; MFU (useful FLOPs) {s['mfu'][0]:.1%}-{s['mfu'][1]:.1%}",
        f"  predicted step {s['predicted_step_s']:.4g} s (MFU {s['predicted_mfu']:.1%}): ops "
        f"{s['ops']['total_s']:.4g} s (dots {s['ops']['dot_flops_s']:.4g}, memory-bound "
        f"{sum(v for k, v in s['ops'].items() if k.endswith('bytes_s')):.4g}, launches "
        f"{s['ops']['kernels_s']:.4g}, loop iterations {s['ops']['loop_iterations_s']:.4g}) + "
        f"collectives on achieved links {s['comm_predicted_s']:.4g} s, no overlap "
        "(trn_accum/analysis/platforms.py); compiled footprint "
        f"{format_bytes(s['memory_bytes'] or 0)} per device, fits {c.get('fits')}",
    ]
    if not st["candidates"]:
        lines.append("  (the config alone; `--search` prices meshes, k and reduce beside it)")
    else:
        lines += [
            "  candidates (k whose analytic bytes fit: "
            + "; ".join(f"{key}: {ks}" for key, ks in st["fit_k"].items())
            + "; compiled for those k; fit = each one's own compiled footprint within the budget, "
            "XLA:CPU's, which keeps bf16 temporaries in float32: an overstatement on trn2"
            + "); bytes per device per step:",
            *st["table"],
        ]
    best = st.get("recommendation")
    if best:
        lines.append(f"  recommended at {c['nodes']} node(s): {best['label']}")
        lines += [f"    - {r}" for r in best["reasons"]]
    if st.get("scale"):
        lines.append("  weak scaling (the recommended mesh, k, reduce; per-node batch fixed):")
        lines.append(
            f"    {'nodes':>5} {'batch':>6} {'floor s':>15} {'MFU':>13} {'efa/device':>11} "
            f"{'predicted s':>11} {'MFU':>6}"
        )
        for r in st["scale"]:
            lines.append(
                f"    {r['nodes']:>5} {r['global_batch']:>6} {r['step_s_full_overlap']:>7.3f}-"
                f"{r['step_s_no_overlap']:<7.3f} {r['mfu'][0]:>6.1%}-{r['mfu'][1]:<6.1%} "
                f"{format_bytes(r['efa_wire_bytes']):>11} {r['predicted_step_s']:>11.3f} "
                f"{r['predicted_mfu']:>6.1%}"
            )
    lines.append(f"  step-time model wall time {st['wall_s']} s")
    return lines
