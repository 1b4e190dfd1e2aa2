"""The docs' tables that the code prints, written from their sources: `make docs`.

    .venv/bin/python benchmarks/docs_tables.py           # rewrite the pages in place
    .venv/bin/python benchmarks/docs_tables.py --check   # exit 1 naming each page that differs

- docs/calibration.md, "The table": one line per row of benchmarks/calibration.json (TPU v5e
  rows first) with its role, measurement, prediction and error;
- docs/performance.md, "How far to trust it": each group's count, median |error| and rows
  within 15 %, from the same rows (the first two cells, prose, stay as written);
- docs/benchmarks.md, the bench section: what benchmarks/report_md.py renders from the
  committed benchmarks/report.json (`make bench-publish` refreshes that report).

Nothing is measured or compiled here: the JSON files are the figures; tests/test_docs.py holds
each page to `rendered()`, so a table cannot drift from its source.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION = ROOT / "benchmarks" / "calibration.json"
REPORT = ROOT / "benchmarks" / "report.json"
TABLE_HEAD = "| row | platform | role | measured s | predicted s | error |"
WITHIN_PCT = 15
# performance.md's groups: (text in the row's first cell, role) -> which calibration rows
GROUPS: dict[tuple[str, str], Callable[[dict], bool]] = {
    ("TPU v5e", "predicted"): lambda r: r["platform"] == "tpu-v5e",
    ("TPU v5e", "fitted"): lambda r: r["platform"] == "tpu-v5e",
    ("Llama-2 7B", "predicted"): lambda r: r["name"] == "trn2-axlearn-llama2-7b",
    ("Llama-2 70B", "fitted"): lambda r: r["name"] == "trn2-axlearn-llama2-70b",
    ("Llama-3.1-8B", "predicted"): lambda r: r["name"] == "trn1-nxdt-llama31-8b",
}


def calibration_lines(rows: list[dict]) -> list[str]:
    """The table's lines after its head and rule: TPU v5e rows first, then the rest."""
    order = [r for r in rows if r["platform"] == "tpu-v5e"]
    order += [r for r in rows if r["platform"] != "tpu-v5e"]
    return [
        f"| `{r['name']}` | {r['platform']} | {r['role']} | {r['measured_s']:g} | "
        f"{r['predicted_s']:g} | {r['error_pct']:+.1f} % |"
        for r in order
    ]


def calibration_page(page: str, rows: list[dict]) -> str:
    """docs/calibration.md with its table's body replaced (the table ends at a blank line)."""
    start = page.index(TABLE_HEAD)
    table, rest = page[start:].split("\n\n", 1) if "\n\n" in page[start:] else (page[start:], "")
    head = table.splitlines()[:2]
    new = "\n".join([*head, *calibration_lines(rows)])
    return page[:start] + new + ("\n\n" + rest if rest else "\n")


def group_cells(rows: list[dict], role: str, pick: Callable[[dict], bool]) -> list[str]:
    """count, median |error| and rows within `WITHIN_PCT` of the rows `pick`ed in `role`."""
    errors = [abs(r["error_pct"]) for r in rows if pick(r) and r["role"] == role]
    within = sum(e <= WITHIN_PCT for e in errors)
    return [str(len(errors)), f"{statistics.median(errors):.1f} %", str(within)]


def performance_page(page: str, rows: list[dict]) -> str:
    """docs/performance.md with each group's figures replaced (the row that names its text
    and `| role`)."""
    lines = page.split("\n")
    for (what, role), pick in GROUPS.items():
        i = next(i for i, ln in enumerate(lines) if what in ln and f"| {role}" in ln)
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        cells[2:] = group_cells(rows, role, pick)
        lines[i] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines)


def benchmarks_page(page: str, report: dict) -> str:
    """docs/benchmarks.md with its bench section rendered from `report`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report_md  # benchmarks/report_md.py, beside this script

    old = report_md.page_section(page)
    if old is None:
        raise SystemExit(f"docs/benchmarks.md: no {report_md.START} ... {report_md.END} markers")
    return page.replace(old, report_md.section(report), 1)


def rendered() -> dict[Path, str]:
    """page -> its text with every generated table as the sources give it now."""
    rows = json.loads(CALIBRATION.read_text(encoding="utf-8"))["rows"]
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    docs = ROOT / "docs"
    render = {
        docs / "calibration.md": lambda text: calibration_page(text, rows),
        docs / "performance.md": lambda text: performance_page(text, rows),
        docs / "benchmarks.md": lambda text: benchmarks_page(text, report),
    }
    return {path: fn(path.read_text(encoding="utf-8")) for path, fn in render.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    a = p.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(text, encoding="utf-8")
    verb = "stale (run `make docs`)" if a.check else "rewritten"
    for path in stale:
        print(f"{path}: {verb}")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
