"""The fit check's memory of the target against what TPU v5e did with each measured config.

    .venv/bin/python benchmarks/target_memory.py [--tpu] [--only NAME ...] [--date D] [--set K=V]
                                                 [--json]

For every config our trainer ran on a TPU v5e chip (15.75 GiB: benchmarks/measured-tpu-v5e.json,
the step-time rows, the 4-layer proxy rows of "memory_rows", and `proxy_rows`: the sweeps of
benchmarks/step_sweep.py with the chip's own footprint, the latest measurement of a case
measured twice), one device, prints:

- estimate: peak live bytes of the step's module in its own dtypes
  (`trn_accum.analysis.live_bytes`, the dry-run's fit figure where no TPU compiler is at hand);
- TPU compiler (`--tpu`, needs the `libtpu` package): the TPU compiler's own footprint, compiled
  on this host without a chip (`trn_accum.analysis.target_memory`); 3-4 minutes a config on 2
  busy cores, about 20 s on the TPU host;
- what the chip did (ran / refused) and whether each verdict at 15.75 GiB agrees with it.

Compiles nothing for the estimate (the lowered module only: seconds a config).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured-tpu-v5e.json"
BUDGET_GIB = 15.75  # the chip's HBM as its compiler states it ("of 15.75G hbm")


def rows() -> list[dict]:
    """{name, config, overrides, chip} of every measured config (chip: "ran" or "refused")."""
    data = json.loads(MEASURED.read_text())
    out = [
        {
            "name": Path(r["config"]).stem,
            "config": r["config"],
            "overrides": _resolved(r.get("resolved")),
            "chip": "ran",
        }
        for r in data["rows"]
    ]
    for r in data.get("memory_rows", []):
        if r.get("overrides") is not None:
            out.append({**r, "name": r["setting"]})
    latest = {}  # a case measured again (a later program) stands for the program now
    for r in data.get("proxy_rows", []):  # benchmarks/step_sweep.py's cases
        chip = "refused" if "error" in r else "ran"
        case = {"name": r["name"], "config": r["config"], "overrides": r["set"], "chip": chip}
        case["date"] = r.get("date")
        latest[(r["config"], tuple(r["set"]))] = case
    return out + list(latest.values())


def _resolved(settings: dict | None) -> list[str]:
    """--set items for what a trainer run resolved from "auto" (its row's `resolved`)."""
    if not settings:
        return []
    return [
        f"trainer.accum_steps={settings['accum_steps']}",
        f"model.remat={settings['remat']}",
        f"model.loss_chunk={settings['loss_chunk']}",
    ]


def _program(row: dict, devices=None):
    """The step of `row` on `devices` (default: this process's first device)."""
    import jax

    from trn_accum.config.load import load_config
    from trn_accum.train import step

    cfg = load_config(str(ROOT / row["config"]), row["overrides"])
    mesh = step.make_mesh(cfg, jax.devices()[:1] if devices is None else devices)
    return step.build_step(cfg, mesh, batch_rows=cfg.data.global_batch)


def measure(row: dict, tpu: bool) -> dict:
    """The row with its estimate (bytes) and, with `tpu`, the TPU compiler's figure."""
    from trn_accum.analysis import target_memory
    from trn_accum.analysis.live_bytes import peak_live_bytes

    out = dict(row)
    out["estimate"] = peak_live_bytes(_program(row).lowered.as_text(dialect="hlo"))
    devices = target_memory.tpu_devices("tpu-v5e", 1) if tpu else None
    if devices is not None:
        out["tpu_compiler"] = target_memory.tpu_footprint(
            lambda d: _program(row, d).lowered, devices
        )
    return out


def table(results: list[dict]) -> str:
    budget = BUDGET_GIB * 2**30
    head = "| config | chip | estimate GiB | agrees | TPU compiler GiB | agrees |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        ran = r["chip"] == "ran"
        cells = [r["name"], r["chip"]]
        for key in ("estimate", "tpu_compiler"):
            b = r.get(key)
            if b is None:
                cells += ["n/a", "-"]
                continue
            agrees = "-" if r["chip"] == "-" else _yes((b <= budget) == ran)
            cells += [f"{b / 2**30:.2f}", agrees]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tpu", action="store_true", help="also the TPU compiler's figure (libtpu)")
    p.add_argument("--only", nargs="*", help="row names")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more overrides on every row chosen (e.g. model.num_layers=2)",
    )
    p.add_argument("--date", help="only the sweep rows measured on this date (YYYY-MM-DD)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    chosen = [r for r in rows() if not args.only or r["name"] in args.only]
    chosen = [r for r in chosen if not args.date or r.get("date") == args.date]
    if args.set:  # another config than the one measured: no chip verdict to agree with
        chosen = [{**r, "overrides": [*r["overrides"], *args.set], "chip": "-"} for r in chosen]
    results = []
    for r in chosen:
        results.append(measure(r, args.tpu))
        shown = {k: results[-1].get(k) for k in ("name", "estimate", "tpu_compiler")}
        print(json.dumps(shown), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
