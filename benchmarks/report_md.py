"""The markdown of a benchmark report (benchmarks/report.py's JSON): the section between the
`bench` markers of docs/benchmarks.md. A pure function of the JSON, so the committed page and
the committed benchmarks/report.json are checked against each other (tests/test_docs.py).

    .venv/bin/python benchmarks/report_md.py benchmarks/out/report.json   # print a run's section
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) if c else "none"


def _bytes(n: float) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{int(n)} B"


def markdown(report: dict) -> str:
    """The configs' tables (the measurement's date stays in the JSON: the page states what the
    command gives, not when)."""
    meta = report["meta"]
    out = [
        f"Measured with `{meta['command']}` on {meta['devices']} emulated CPU devices (jax "
        f"{meta['jax']}, {meta['cpus']} shared cores, load average {meta['load_before']:.1f} "
        f"before / {meta['load_after']:.1f} after; total {meta['total_s']:.0f} s). The "
        "trainer's real step (accumulation, clipping, AdamW, donated state) at a fixed global "
        "batch. XLA:CPU is a proxy for trn2: temporaries are not a fit check, collectives are "
        "memory copies, times are noisy on a shared machine.",
        "",
        "Data all-reduces: all-reduces whose replica groups span the `data` axis, inside / "
        "outside the accumulation loop (the layer scan is a loop too; counted by computation "
        "membership). Bytes per step: their result bytes × the trip counts of the loops around "
        "them. XLA:CPU writes an fsdp reduce-scatter as an all-reduce plus a dynamic-slice, and "
        "per minibatch reduces the tied embedding's two gradient contributions separately, so "
        "the fall from `per_minibatch` to `once` can exceed k. Runs use "
        "`--xla_cpu_enable_concurrency_optimized_scheduler=false` (an XLA:CPU collective "
        "deadlock otherwise, see the script).",
        "",
    ]
    for c in report["configs"]:
        sp = c["split_collectives"]
        mesh = ", ".join(f"{a}={n}" for a, n in c["mesh"].items())
        out += [
            f"**{c['name']}**: {c['model']}; {c['params']:,} parameters; mesh ({mesh}); batch "
            f"{c['global_batch']} × {c['seq_len']} = {c['tokens_per_step']:,} tokens per step"
            + (f" (overrides: `{' '.join(c['overrides'])}`)" if c["overrides"] else "")
            + ".",
            f"Split alone at k={c['split_k']}: strided (ours) {_counts(sp['strided'])}; "
            f"contiguous {_counts(sp['contiguous'])}.",
            "",
            "| k | reduce | data all-reduces in / outside the accumulation loop | data-axis bytes "
            f"per step | temp per device | compile | step (median of {c['runs']}) | vs k=1 | "
            "tokens/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in c["rows"]:
            d = r["data_all_reduces"]
            ratio = r.get("step_ratio_to_k1")
            temp_ratio = r.get("temp_ratio_to_k1")
            out.append(
                f"| {r['k']} | {r['reduce']} | {d['inside_loop']} / {d['outside_loop']} | "
                f"{_bytes(d['bytes_per_step'])} | {_bytes(r['temp_bytes'])}"
                + (f" ({temp_ratio:.2f}×)" if temp_ratio is not None else "")
                + f" | {r['compile_s']:.1f} s | {r['step_s_median'] * 1e3:.0f} ms | "
                + (f"{ratio:.2f}" if ratio is not None else "-")
                + f" | {r['tokens_per_s']:,.0f} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def section(report: dict) -> str:
    """The whole bench section: the configs' tables, then the peers' (when measured)."""
    text = markdown(report)
    if "peers" in report:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import peers  # benchmarks/peers.py, beside this script

        text += "\n" + peers.markdown(report["peers"])
    return text


def page_section(page: str) -> str | None:
    """The text between the markers of a page (None unless it has them once)."""
    found = re.findall(re.escape(START) + r"\n(.*?)" + re.escape(END), page, re.S)
    return found[0] if len(found) == 1 else None


def replace_section(path: Path, text: str) -> bool:
    """Replaces what lies between the markers of the page at `path`; False (the page untouched)
    when they are missing."""
    if not path.exists():
        return False
    page = path.read_text(encoding="utf-8")
    if page_section(page) is None:
        return False
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    new = pattern.sub(lambda _: f"{START}\n{text}{END}", page)
    if new != page:
        path.write_text(new, encoding="utf-8")
    return True


if __name__ == "__main__":
    print(section(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))), end="")
