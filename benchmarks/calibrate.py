"""The step-time model against measured steps: benchmarks/calibration.json, recomputed.

Every row of the table has a config, a platform, a measured step time with where it comes from
(a command run on our trainer, or a published figure with its URL), the command that prints
the model's prediction, and a role: "fitted" (its measurement set a constant of
`trn_accum/analysis/platforms.py`) or "predicted" (it did not).

    python benchmarks/calibrate.py                 # rerun every row's prediction, rewrite the file
    python benchmarks/calibrate.py --rows NAME,..  # only these rows
    python benchmarks/calibrate.py --fit tpu-v5e   # print that platform's efficiencies fitted
                                                   # on its "fitted" rows (stored features)
    python benchmarks/calibrate.py --fit trn2 --free overlap   # its overlap instead
    python benchmarks/calibrate.py --reprice       # predictions from the stored features at
                                                   # the constants now in platforms.py
    python benchmarks/calibrate.py --predict NAME  # one row's (or target's) prediction as JSON
    python benchmarks/calibrate.py --predict fuji-3b-trn2 --set model.attention=flash
                                                   # the same with config overrides
    python benchmarks/calibrate.py --targets       # recompute the targets' stored features
    python benchmarks/calibrate.py --range NAME    # a target's prediction under every
                                                   # alternative the Trainium rows allow
    python benchmarks/calibrate.py --features tpu-v5e  # its one-device rows' stored features
                                                   # from their lowered programs (no compile)
    python benchmarks/calibrate.py --roofline tpu-v5e  # its rows priced kernel by kernel at
                                                   # the measured rates, nothing fitted

A TPU row's prediction is `trn-accum dry-run --config C --platform tpu-v5e --devices 1 --json`
(step_time.config.summary.predicted_step_s). A Trainium row's is `--predict NAME`: the model of
the config alone at its node count (`trn_accum.plan.perfmodel.predict`, compiled at 2 and 3
layers on at most 2 emulated nodes and extrapolated), without the dry-run's candidate sweep,
which at 64 nodes of a 70B model would compile for hours on a laptop.

The fit: a prediction is linear in the inverse efficiencies (`trn_accum.analysis.pricing`), so
the free ones are the non-negative least-squares solution over the fitted rows' features
(scipy.optimize.nnls); the others keep their values. It prints the constants to put in
platforms.py; `--reprice` then rewrites the predictions from the stored features, which is
what the commands print (tests/test_calibration.py reruns the cheapest row to check).

The range: a target (the table's "targets": a config we ship, no measurement) is priced under
every alternative of `ALTERNATIVES` (the trn2 constants no published row pins down) that keeps
every Trainium row within the target error; it prints the span of the target's step time and
the central figure, the prediction at the constants in platforms.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "calibration.json"
TARGET_PCT = 25.0
TRAINIUM = ("trn2", "trn1")

# What the published Trainium rows leave open (trn1 shares trn2's efficiencies and overlap,
# platforms.py), each a bound of what is plausible, not a measurement: the dot efficiency
# (0.85 is about what a bare bf16 matmul reaches on a TPU v5e; no trn2 matmul profile is
# published), the elementwise efficiencies borrowed from the TPU v5e fit (x 1/4 to x 4), the
# fixed cost of a loop iteration in microseconds (the TPU fit gives it no share; 0 to 50 us, an
# assumption), the collectives' achieved time (nccom-test's published bandwidths, x 1/2 to x 2)
# and the overlap of ops and collectives (an assumption, 0 to 1). The platform's own value of
# each is added.
ALTERNATIVES = {
    "dot": (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.85),
    "elementwise": (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0),
    "loop_iteration_us": (0.0, 2.0, 5.0, 10.0, 20.0, 50.0),
    "comm": (0.5, 0.75, 1.0, 1.5, 2.0),
    "overlap": (0.0, 0.25, 0.5, 0.75, 1.0),
}


def load(path: pathlib.Path = TABLE) -> dict:
    return json.loads(path.read_text())


def error_pct(predicted: float, measured: float) -> float:
    return round(100.0 * (predicted - measured) / measured, 1)


def _summary_of_dry_run(stdout: str) -> dict:
    report = json.loads(stdout)
    st = report["step_time"]
    if "error" in st:
        raise RuntimeError(st["error"])
    return st["config"]["summary"]


def run_row(row: dict) -> dict:
    """The row's prediction command run here: the summary it prints."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cmd = row["predict_command"].split()
    if cmd[0] == "trn-accum":
        cmd = [sys.executable, "-m", "trn_accum.cli", *cmd[1:]]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        return _summary_of_dry_run(out.stdout)
    cmd = [sys.executable if c == "python" else c for c in cmd]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def predict_here(row: dict) -> dict:
    """`perfmodel.predict` of the row's config on its platform and node count (this process
    must have the emulated devices: `predict_in_subprocess`)."""
    from trn_accum.analysis import platforms, steptime
    from trn_accum.config.load import load_config
    from trn_accum.plan import perfmodel

    plat = platforms.get(row["platform"])
    cfg = load_config(str(ROOT / row["config"]), row.get("overrides", []))
    layout = steptime.Layout.of(plat)
    return perfmodel.predict(cfg, nodes=row["nodes"], layout=layout, plat=plat)


def _entries(table: dict) -> dict[str, dict]:
    """Rows and targets by name."""
    return {r["name"]: r for r in [*table["rows"], *table.get("targets", [])]}


def refresh_targets(table: dict) -> None:
    """Each target's features and collectives, from its `--predict` command (a subprocess
    with the emulated devices it needs)."""
    from trn_accum.analysis.pricing import FEATURES

    for t in table.get("targets", []):
        s = run_row(t)
        t["features"] = {k: s["ops"][k] for k in FEATURES}
        t["comm_predicted_s"] = s["comm_predicted_s"]
        t["predicted_s"] = round(s["predicted_step_s"], 4)
        print(f"{t['name']:<40} predicted {t['predicted_s']:8.4f}", flush=True)


def predict_in_subprocess(name: str, sets: Sequence[str] = ()) -> int:
    from trn_accum.analysis import platforms
    from trn_accum.plan.perfmodel import EMULATE_NODES

    row = _entries(load())[name]
    n = platforms.get(row["platform"]).devices_per_node * min(row["nodes"], EMULATE_NODES)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env["TRN_ACCUM_CALIBRATE_CHILD"] = "1"
    cmd = [sys.executable, __file__, "--predict", name, *(f"--set={x}" for x in sets)]
    return subprocess.call(cmd, env=env, cwd=ROOT)


def _fit_overlap(rows: list[dict], plat) -> float:
    """The overlap that makes the fitted rows' mean prediction their measurement:
    measured = ops + comm - overlap x min(ops, comm), clipped to [0, 1]."""
    got = []
    for r in rows:
        ops = price_row(r, plat)
        hidden = min(ops, r["comm_predicted_s"])
        got.append((ops + r["comm_predicted_s"] - r["measured_s"]) / hidden if hidden else 0.0)
    return min(1.0, max(0.0, sum(got) / len(got)))


def fitted_efficiency(rows: list[dict], plat, free: list[str]):
    """`plat`'s efficiency with the `free` features' coefficients solved by non-negative least
    squares on `rows`' stored features and measurements (with the platform's overlap: the rows'
    ops taken as the longer of ops and collectives when overlap is 1); the rest kept. A free
    item "a+b" is one coefficient shared by features a and b (their sum is its column)."""
    import dataclasses

    import numpy as np
    from scipy.optimize import nnls

    from trn_accum.analysis import pricing

    coef = plat.efficiency.coefficients(plat.peak_flops, plat.hbm_bytes_s)
    groups = [item.split("+") for item in free]
    a = np.array(
        [[sum(r["features"].get(f, 0.0) for f in g) for g in groups] for r in rows], dtype=float
    )
    fixed = [f for f in pricing.FEATURES if not any(f in g for g in groups)]
    b = np.array(
        [
            r["measured_s"]
            - (1.0 - plat.overlap) * r["comm_predicted_s"]
            - sum(r["features"].get(f, 0.0) * coef[f] for f in fixed)
            for r in rows
        ]
    )
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(a / scale, b)
    for g, v, sc in zip(groups, x, scale, strict=True):
        coef.update(dict.fromkeys(g, float(v / sc)))
    got = pricing.Efficiency.from_coefficients(coef, plat.peak_flops, plat.hbm_bytes_s)
    keep = ("tile", "source", "rates", "onchip_bytes")
    return dataclasses.replace(got, **{k: getattr(plat.efficiency, k) for k in keep})


def fit(table: dict, platform_name: str, free: list[str]) -> None:
    """Print the constants of `platform_name` fitted on its "fitted" rows (stored features):
    the `free` efficiencies (`fitted_efficiency`), or with free = ["overlap"] the overlap. Put
    them in platforms.py, then `--reprice`."""
    from trn_accum.analysis import platforms

    plat = platforms.get(platform_name)
    fitted = [r for r in table["rows"] if r["platform"] == platform_name and r["role"] == "fitted"]
    if not fitted or any("features" not in r for r in fitted):
        raise SystemExit(f"{platform_name}: run its fitted rows first (no stored features)")
    if free == ["overlap"]:
        print(f"{platform_name}: overlap={_fit_overlap(fitted, plat):.4g}")
        return
    eff = fitted_efficiency(fitted, plat, free)
    print(
        f"{platform_name}: Efficiency(dot={eff.dot:.4g}, memory={eff.memory:.4g}, "
        f"elementwise={eff.elementwise:.4g}, loop_elementwise={eff.loop_elementwise:.4g}, "
        f"kernel_s={eff.kernel_s:.4g}, "
        f"loop_iter_s={eff.loop_iter_s:.4g}, offchip_elementwise={eff.offchip_elementwise:.4g})"
    )


def price_row(row: dict, plat) -> float:
    """The ops seconds of a row's stored features at `plat`'s efficiencies."""
    from trn_accum.analysis import pricing

    return pricing.price(row["features"], plat.peak_flops, plat.hbm_bytes_s, plat.efficiency)[
        "total_s"
    ]


def step_s(row: dict, plat, alt: dict | None = None) -> float:
    """The step seconds of a row's (or target's) stored features and collectives at `plat`'s
    constants, or at the alternative `alt` (keys of `ALTERNATIVES`): ops + comm - overlap x
    min(ops, comm), as `trn_accum.analysis.stepsummary` combines them."""
    import dataclasses

    from trn_accum.analysis import pricing

    eff, comm, overlap = plat.efficiency, row["comm_predicted_s"], plat.overlap
    if alt is not None:
        eff = dataclasses.replace(
            eff,
            dot=alt["dot"],
            elementwise=eff.elementwise * alt["elementwise"],
            loop_elementwise=eff.loop_elementwise * alt["elementwise"],
            offchip_elementwise=eff.offchip_elementwise * alt["elementwise"],
            loop_iter_s=alt["loop_iteration_us"] * 1e-6,
        )
        comm, overlap = comm * alt["comm"], alt["overlap"]
    ops = pricing.price(row["features"], plat.peak_flops, plat.hbm_bytes_s, eff)["total_s"]
    return ops + comm - overlap * min(ops, comm)


def alternatives(plat) -> list[dict]:
    """Every combination of `ALTERNATIVES`, the platform's own value of each included."""
    import itertools

    own = {"dot": plat.efficiency.dot, "overlap": plat.overlap, "elementwise": 1.0, "comm": 1.0}
    own["loop_iteration_us"] = plat.efficiency.loop_iter_s * 1e6
    axes = {k: sorted(set(v) | {own[k]}) for k, v in ALTERNATIVES.items()}
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def step_range(table: dict, name: str) -> dict:
    """The target `name` priced at its platform's constants ("central_s") and under every
    alternative that keeps every Trainium row within `TARGET_PCT` ("low_s", "high_s" and the
    alternatives at each end; "admissible" of "alternatives" kept)."""
    from trn_accum.analysis import platforms

    target = {t["name"]: t for t in table.get("targets", [])}[name]
    plat = platforms.get(target["platform"])
    rows = [r for r in table["rows"] if r["platform"] in TRAINIUM]
    every = alternatives(plat)
    kept = [
        a
        for a in every
        if all(
            abs(step_s(r, platforms.get(r["platform"]), a) - r["measured_s"])
            <= TARGET_PCT / 100 * r["measured_s"]
            for r in rows
        )
    ]
    if not kept:
        raise SystemExit(f"{name}: no alternative keeps every Trainium row within the target")
    priced = sorted((step_s(target, plat, a), i) for i, a in enumerate(kept))
    (low, lo_i), (high, hi_i) = priced[0], priced[-1]
    return {
        "name": name,
        "central_s": step_s(target, plat),
        "low_s": low,
        "high_s": high,
        "low_at": kept[lo_i],
        "high_at": kept[hi_i],
        "admissible": len(kept),
        "alternatives": len(every),
        "rows": [r["name"] for r in rows],
    }


def _describe_range(got: dict) -> str:
    def at(a: dict) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in a.items())

    return (
        f"{got['name']}: {got['central_s']:.2f} s at the platform's constants; "
        f"{got['low_s']:.2f} to {got['high_s']:.2f} s under the {got['admissible']} of "
        f"{got['alternatives']} alternatives that keep {', '.join(got['rows'])} within "
        f"+-{TARGET_PCT:g} %\n  fastest at: {at(got['low_at'])}\n"
        f"  slowest at: {at(got['high_at'])}"
    )


def reprice(table: dict) -> None:
    """Every row's prediction from its stored features and collectives at the constants now in
    platforms.py (what its command prints: pricing is linear, no compile needed)."""
    from trn_accum.analysis import platforms

    for r in table["rows"]:
        if "features" not in r:
            continue
        r["predicted_s"] = round(step_s(r, platforms.get(r["platform"])), 4)
        r["error_pct"] = error_pct(r["predicted_s"], r["measured_s"])
        print(
            f"{r['name']:<40} measured {r['measured_s']:8.4f} predicted {r['predicted_s']:8.4f}"
            f" ({r['error_pct']:+.1f} %, {r['role']})"
        )


def refresh(table: dict, names: list[str] | None) -> None:
    from trn_accum.analysis.pricing import FEATURES

    for r in table["rows"]:
        if names and r["name"] not in names:
            continue
        s = run_row(r)
        r["predicted_s"] = round(s["predicted_step_s"], 4)
        r["floor_s"] = round(s["step_s_no_overlap"], 4)
        r["error_pct"] = error_pct(r["predicted_s"], r["measured_s"])
        r["features"] = {k: s["ops"][k] for k in FEATURES}
        r["comm_predicted_s"] = s["comm_predicted_s"]
        print(
            f"{r['name']:<40} measured {r['measured_s']:8.4f} predicted {r['predicted_s']:8.4f}"
            f" ({r['error_pct']:+.1f} %, {r['role']})",
            flush=True,
        )


def dry_run_args(row: dict) -> tuple[str, list[str]]:
    """(config path, --set items) of a one-device dry-run row's command."""
    cmd = shlex.split(row["predict_command"])
    if cmd[:2] != ["trn-accum", "dry-run"] or cmd[cmd.index("--devices") + 1] != "1":
        raise SystemExit(f"{row['name']}: not a one-device dry-run: {row['predict_command']}")
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    return cmd[cmd.index("--config") + 1], sets


def lowered_module(row: dict):
    """The module a one-device row's dry-run prices, by lowering alone: a program of one
    partition skips the SPMD partitioner, so its module before XLA's optimizations is what
    `trn_accum.analysis.hlo.partitioned` reads (tests/test_rates.py checks the two agree)."""
    import jax

    from trn_accum.analysis.hlo.module import parse_hlo
    from trn_accum.config.load import load_config
    from trn_accum.train import step as step_lib

    path, sets = dry_run_args(row)
    cfg = load_config(str(ROOT / path), sets)
    mesh = step_lib.make_mesh(cfg, jax.devices()[:1])
    with jax.set_mesh(mesh):
        program = step_lib.build_step(cfg, mesh, batch_rows=cfg.data.global_batch)
        return parse_hlo(program.lowered.as_text(dialect="hlo"))


def refresh_features(table: dict, platform_name: str) -> None:
    """The stored features of the platform's one-device rows, from their lowered programs (a
    second each: no compile), and their roofline groups (`trn_accum.analysis.roofline`)."""
    from trn_accum.analysis import platforms, pricing, roofline

    eff = platforms.get(platform_name).efficiency
    for r in table["rows"]:
        if r["platform"] != platform_name:
            continue
        module = lowered_module(r)
        f = pricing.op_features(module, eff.tile, eff.rates, eff.onchip_bytes)
        r["features"] = {k: f[k] for k in pricing.FEATURES}
        r["roofline_groups"] = roofline.aggregate(roofline.fusions(module, eff.tile))
        print(f"{r['name']:<60} features stored", flush=True)


def roofline_table(table: dict, platform_name: str) -> None:
    """Each row's step priced kernel by kernel at the platform's measured rates (no fit), the
    dots' share of that, and the measured step."""
    import statistics

    from trn_accum.analysis import platforms, roofline

    plat = platforms.get(platform_name)
    if plat.efficiency.rates is None:
        raise SystemExit(
            f"--roofline {platform_name}: no op rates measured for it (platforms.py); "
            "measure them with benchmarks/op_rates.py on its chip (tpu-v5e has them)"
        )
    errs = []
    for r in table["rows"]:
        if r["platform"] != platform_name or "roofline_groups" not in r:
            continue
        s = roofline.seconds(
            roofline.from_rows(r["roofline_groups"]),
            r["features"]["loop_iterations"],
            plat.peak_flops,
            plat.hbm_bytes_s,
            plat.efficiency.rates,
        )
        errs.append(error_pct(s["total_s"], r["measured_s"]))
        print(
            f"{r['name']:<60} measured {r['measured_s']:.4f} roofline {s['total_s']:.4f} "
            f"({errs[-1]:+.1f} %): dots {s['dot_s']:.4f}, fused {s['fused_s']:.4f}, "
            f"kernels {s['kernel_s']:.4f}, loops {s['loop_s']:.4f}"
        )
    if errs:
        print(
            f"{len(errs)} rows: error {min(errs):+.1f} to {max(errs):+.1f} %, median |error| "
            f"{statistics.median(abs(e) for e in errs):.1f} %"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/calibrate.py")
    p.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    p.add_argument("--fit", default=None, metavar="PLATFORM")
    p.add_argument(
        "--free",
        default="dot_flops,kernel_bytes,elementwise_bytes,loop_elementwise_bytes",
        help="the features whose coefficients --fit sets",
    )
    p.add_argument("--predict", default=None, metavar="NAME")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="--predict's overrides"
    )
    p.add_argument("--reprice", action="store_true", help="predictions from stored features")
    p.add_argument("--targets", action="store_true", help="recompute the targets' features")
    p.add_argument("--range", default=None, metavar="NAME", help="a target's step-time range")
    p.add_argument("--json", action="store_true", help="--range as JSON")
    p.add_argument(
        "--features", default=None, metavar="PLATFORM", help="its one-device rows' features"
    )
    p.add_argument("--roofline", default=None, metavar="PLATFORM", help="its rows kernel by kernel")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if a.predict:
        if not os.environ.get("TRN_ACCUM_CALIBRATE_CHILD"):
            return predict_in_subprocess(a.predict, a.set)
        row = _entries(load())[a.predict]
        row = {**row, "overrides": [*row.get("overrides", []), *a.set]}
        print(json.dumps(predict_here(row), default=str))
        return 0
    table = load()
    if a.range:
        got = step_range(table, a.range)
        print(json.dumps(got) if a.json else _describe_range(got))
        return 0
    if a.targets:
        refresh_targets(table)
        TABLE.write_text(json.dumps(table, indent=1) + "\n")
        return 0
    if a.features:
        refresh_features(table, a.features)
        TABLE.write_text(json.dumps(table, indent=1) + "\n")
        return 0
    if a.roofline:
        roofline_table(table, a.roofline)
        return 0
    if a.fit:
        fit(table, a.fit, a.free.split(","))
        return 0
    if a.reprice:
        reprice(table)
    else:
        refresh(table, None if a.rows is None else a.rows.split(","))
    bad = [r["name"] for r in table["rows"] if abs(r.get("error_pct", 1e9)) > TARGET_PCT]
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"rows outside +-{TARGET_PCT:g} %: {bad or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
