"""`trn-accum neuron-check`: prove each risky piece of a trn2 run on the first node, in minutes.

Each row compiles and runs one small program on this process's devices and compares it with
its reference (the same program another way, on the same devices, or exact arithmetic):

    root          the runtime's root address resolves, its port is free (bind test) and
                  reserved from the ephemeral range (run first, before the backend starts)
    platform      the JAX backend and its device count (64 per trn2.48xlarge at LNC=2)
    lnc           compiler and runtime logical-core size agree, and the runtime's device count
                  is what that size gives
    topology      no model or fsdp group of the mesh spans Neuron devices that
                  `neuron-ls --topology` shows unconnected (where neuron-ls exists)
    prng          the PRNG in use (rbg on Neuron), a jitted draw equal to an eager one
    psum          an all-device psum equal to its exact integer sum
    psum-procs    the same across processes (multi-process jobs only)
    accumulate    the real train step (the config's model pieces, reduced size) at k=4 equal to
                  k=1: loss and gradient norm
    reduce-once   reduce="once" equal to "per_minibatch"
    gather-once   trainer.gather = "once_unsharded" equal to "per_minibatch" (under "once")
    blockwise     blockwise attention equal to plain (output and gradients)
    flash         the loop-free flash attention equal to plain (output and gradients)
    neuron-flash  neuron_flash equal to blockwise (the NKI kernels where importable, else the
                  CPU stand-ins, marked so), in float32 and in a sharp bf16 case that an
                  NKI Library before 2.30 fails (its attention_bwd scaled Q in bf16)
    kernel-pair   the NKI kernels at the job's per-device shape and LNC, an odd B x KV at LNC=2
                  included when the heads give one (trn2 only: off Neuron it is skipped and
                  names the shapes it would run; trn_accum/plan/node_rows.py)
    remat         a remat'ed bf16 layer equal to the plain one, compiled as the trainer compiles
                  it (on Neuron without remat's identity reduce-precision, which Neuron lists
                  unsupported: trn_accum/neuron/lowering.py)
    checkpoint    a save and restore on the run directory's filesystem, bit-exact
    cache         the compile-cache directories writable

Exit 0 only if every applicable row passes; a failing row names the piece and what it saw.
When root, platform or lnc fails, the model rows (accumulate ... remat) are skipped: they would
compile for devices that are not what the job gets; the report names the row to fix first.
Off-Neuron the same rows run on emulated CPU devices with the stand-ins marked; the test suite
runs it there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import jax

from trn_accum.config.load import load_config
from trn_accum.errors import EXIT_FAILED, EXIT_OK
from trn_accum.neuron import platform
from trn_accum.plan import node_rows
from trn_accum.plan.node_rows import FAIL
from trn_accum.plan.numerics_rows import (
    SHARP,
    row_accumulate,
    row_blockwise,
    row_flash,
    row_gather_once,
    row_neuron_flash,
    row_reduce_once,
    row_remat,
)
from trn_accum.plan.probe import Check
from trn_accum.plan.runtime_rows import (
    row_cache,
    row_checkpoint,
    row_lnc,
    row_platform,
    row_prng,
    row_psum,
    row_psum_procs,
    row_topology,
)

__all__ = ["ROWS", "SHARP", "Check", "Row", "exit_code", "format_report", "run"]


@dataclasses.dataclass
class Row:
    piece: str
    status: str
    detail: str
    seconds: float = 0.0


ROWS: tuple[tuple[str, Callable[[Check], tuple[str, str]]], ...] = (
    ("platform", row_platform),
    ("lnc", row_lnc),
    ("topology", row_topology),
    ("prng", row_prng),
    ("psum", row_psum),
    ("psum-procs", row_psum_procs),
    ("accumulate", row_accumulate),
    ("reduce-once", row_reduce_once),
    ("gather-once", row_gather_once),
    ("blockwise", row_blockwise),
    ("flash", row_flash),
    ("neuron-flash", row_neuron_flash),
    ("kernel-pair", node_rows.row_kernel_pair),
    ("remat", row_remat),
    ("checkpoint", row_checkpoint),
    ("cache", row_cache),
)


#: The rows that say what this node's devices are: when one fails, the model rows below would
#: compile and run minutes of programs for the wrong devices; they are skipped, named so.
ENVIRONMENT = ("root", "platform", "lnc")
MODEL_ROWS = frozenset(
    (
        "accumulate",
        "reduce-once",
        "gather-once",
        "blockwise",
        "flash",
        "neuron-flash",
        "kernel-pair",
        "remat",
    )
)


def _row(piece: str, fn: Callable[[], tuple[str, str]]) -> Row:
    """fn() as a timed Row; a row that raises fails with its one-line cause."""
    t = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as e:  # the row's piece is broken: name it, keep going
        last = traceback.extract_tb(e.__traceback__)[-1]
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        status, detail = (
            FAIL,
            f"{type(e).__name__}: {msg} (at {os.path.basename(last.filename)}:{last.lineno})",
        )
    return Row(piece, status, detail, round(time.perf_counter() - t, 2))


def print_progress(line: str) -> None:
    """`run`'s default progress: each line on stderr as it comes (stdout keeps the report)."""
    print(line, file=sys.stderr, flush=True)


def progress_line(row: Row, index: int, total: int) -> str:
    """One finished row as the progress shows it: `[ 3/16] pass  prng  ...  [0.4 s]`."""
    width = max(len(name) for name in ("root", *(p for p, _ in ROWS)))
    return (
        f"[{index:>{len(str(total))}}/{total}] {row.status:<4}  {row.piece:<{width}}  "
        f"{row.detail}  [{row.seconds:.1f} s]"
    )


def run(
    config_path: str,
    *,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
    progress: Callable[[str], None] | None = print_progress,
) -> dict:
    """Every row, in order; a row that raises fails with its one-line cause. After a failed
    ENVIRONMENT row the MODEL_ROWS are skipped (the cheap rows still run). `progress` (None:
    quiet) gets a first line naming the rows, then each row as it finishes (`progress_line`):
    the model rows take minutes on CPU."""
    t0 = time.perf_counter()
    say = progress or (lambda line: None)
    cfg = load_config(config_path, overrides)
    run_dir = run_dir or os.environ.get("TRN_ACCUM_RUN_DIR") or os.path.join("runs", "neuron-check")
    total = len(ROWS) + 1
    say(f"neuron-check: {total} rows, each printed as it finishes (the model rows take longest)")
    # before the backend starts: the runtime itself may bind the root port then
    on_neuron = platform.neuron_available()
    rows = [_row("root", lambda: node_rows.row_root(os.environ, on_neuron=on_neuron))]
    say(progress_line(rows[0], 1, total))
    check = Check(cfg, run_dir)
    for piece, fn in ROWS:
        broken = [r.piece for r in rows if r.piece in ENVIRONMENT and r.status == FAIL]
        if piece in MODEL_ROWS and broken:
            why = f"not run: {', '.join(broken)} failed (fix it first; this row compiles for it)"
            rows.append(Row(piece, node_rows.SKIP, why))
        else:
            rows.append(_row(piece, functools.partial(fn, check)))
        say(progress_line(rows[-1], len(rows), total))
    if on_neuron:  # what this node proved, for the settings search (neuron_flash once it passed)
        from trn_accum.plan.settings import record_neuron_check

        record_neuron_check({r.piece: r.status for r in rows})
    return {
        "config": config_path,
        "backend": jax.default_backend(),
        "devices": len(check.devices),
        "processes": jax.process_count(),
        "rows": [dataclasses.asdict(r) for r in rows],
        "passed": all(r.status != FAIL for r in rows),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def exit_code(report: dict) -> int:
    return EXIT_OK if report["passed"] else EXIT_FAILED


def format_report(report: dict, *, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(report, indent=2)
    width = max(len(r["piece"]) for r in report["rows"])
    lines = [
        f"neuron-check of {report['config']}: backend {report['backend']}, "
        f"{report['devices']} devices, {report['processes']} process(es)"
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['status']:<4}  {r['piece']:<{width}}  {r['detail']}  [{r['seconds']:.1f} s]"
        )
    failed = [r["piece"] for r in report["rows"] if r["status"] == FAIL]
    verdict = "all rows pass" if not failed else f"FAILED: {', '.join(failed)}"
    lines.append(f"{verdict} ({report['seconds']:.0f} s)")
    return "\n".join(lines)
