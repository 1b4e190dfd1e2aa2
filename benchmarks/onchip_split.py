"""The step-time model's on-chip split checked on held-out rows (issue 46).

    python benchmarks/onchip_split.py                    # on-chip sizes 64, 128, 256 MiB and none
    python benchmarks/onchip_split.py --mib 128 --fit-on tpu-v5e-k,tpu-v5e-span

For each on-chip size, every TPU v5e row of benchmarks/calibration.json is priced with
`offchip_elementwise_bytes` counted at that size (`trn_accum.analysis.pricing`: elementwise
results at least that large), the elementwise rates are fitted on the fitting rows
(`calibrate.fitted_efficiency`: the rows marked fitted, or those whose names start with one of
`--fit-on`'s prefixes), and the other rows are predicted. It prints, per size, the fitted rates
and the held-out rows' median |error|, how many are within the table's +-15 % aim, and the
largest |error|. Each row's program is lowered once (no compile, about 2 minutes in all); the
table is not written. Size "none" is the model without the split (the off-chip extra free).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# one rate for elementwise bytes in and out of loops, and the off-chip extra (platforms.py)
FREE = ["elementwise_bytes+loop_elementwise_bytes", "offchip_elementwise_bytes"]
AIM_PCT = 15.0


def held_out(rows: list[dict], plat, onchip: float, fitting) -> dict:
    """{"efficiency", "errors"}: `rows` (with their "module") priced at `onchip` bytes, the
    elementwise rates fitted on the rows `fitting(row)` picks, the others' errors in %."""
    from benchmarks import calibrate
    from trn_accum.analysis import pricing

    eff = dataclasses.replace(plat.efficiency, onchip_bytes=onchip)
    priced = [
        {**r, "features": pricing.op_features(r["module"], eff.tile, eff.rates, onchip)}
        for r in rows
    ]
    free = FREE if math.isfinite(onchip) else FREE[:1]
    at = dataclasses.replace(plat, efficiency=eff)
    got = calibrate.fitted_efficiency([r for r in priced if fitting(r)], at, free)
    at = dataclasses.replace(plat, efficiency=got)
    errors = {
        r["name"]: calibrate.error_pct(calibrate.step_s(r, at), r["measured_s"])
        for r in priced
        if not fitting(r)
    }
    return {"efficiency": got, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/onchip_split.py")
    p.add_argument("--mib", nargs="+", default=["64", "128", "256", "none"])
    p.add_argument("--fit-on", default=None, help="comma-separated row-name prefixes")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks import calibrate
    from trn_accum.analysis import platforms

    plat = platforms.get("tpu-v5e")
    rows = [r for r in calibrate.load()["rows"] if r["platform"] == "tpu-v5e"]
    for r in rows:
        r["module"] = calibrate.lowered_module(r)
    prefixes = tuple(a.fit_on.split(",")) if a.fit_on else None

    def fitting(r: dict) -> bool:
        return r["name"].startswith(prefixes) if prefixes else r["role"] == "fitted"

    for mib in a.mib:
        onchip = math.inf if mib == "none" else float(mib) * 2**20
        got = held_out(rows, plat, onchip, fitting)
        e, errs = got["efficiency"], list(got["errors"].values())
        within = sum(abs(x) <= AIM_PCT for x in errs)
        print(
            json.dumps(
                {
                    "onchip_mib": mib,
                    "elementwise": round(e.elementwise, 3),
                    "loop_elementwise": round(e.loop_elementwise, 3),
                    "offchip_elementwise": round(e.offchip_elementwise, 3),
                    "held_out": len(errs),
                    "median_abs_error_pct": round(statistics.median(abs(x) for x in errs), 1),
                    "within_15_pct": within,
                    "max_abs_error_pct": round(max(abs(x) for x in errs), 1),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
