"""Many train-step settings timed in one process on the chip at hand: step seconds, MFU and the
chip compiler's own memory figure for each (issues 45 and 46).

    python3 benchmarks/step_sweep.py benchmarks/sweeps/proxy.json --out rows.jsonl

From the repository root, package importable (PYTHONPATH=.), JAX_PLATFORMS unset on a TPU.
The cases file is a JSON list of {"name", "config", "set": ["section.key=value", ...]}; each case
is `trn_accum.config.load.load_config(config, set)` (what `trn-accum train --config C --set ...`
reads), built by the trainer's own `trn_accum.train.trainer.Trainer.build` (mesh, every "auto"
resolved by the settings search `trn-accum train` runs, the compiled step, the config's data).
Opening the chip once for every case saves the ~15 s each process pays (measure_tpu.py's one
process per config runs the trainer whole, data and logging included).

Per case, one JSON line:

- `compile_s`; `memory`: `compiled.memory_analysis()` (argument, output, alias, temp and
  generated-code bytes) and `footprint_bytes`, the chip compiler's footprint
  (`trn_accum.analysis.memory.footprint`: arguments + outputs - aliased + temporaries; the
  fit check's estimate beside it: benchmarks/target_memory.py);
  `bytes_limit` and `peak_bytes_in_use` from the chip's `memory_stats()`;
- `step_times_s`: each of `--steps` steps after `--warmup`, wall time from the call to
  `jax.block_until_ready` of the new state and metrics (the config's batches 0 and 1 alternate, made
  before the clock starts: the device's step, not the host's data);
- `median_step_s`, `mfu` = `train.flops.flops_per_step(cfg)["total"]` / median / the
  platform's peak (`--platform`, default tpu-v5e: 197e12);
- or `error`: the exception's first line, and `refused_bytes` when the compiler's refusal
  names what it asked (`trn_accum.analysis.target_memory.refused_bytes`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import jax

from trn_accum.analysis import platforms
from trn_accum.analysis.memory import compiled_memory, footprint
from trn_accum.analysis.target_memory import refused_bytes
from trn_accum.config.load import load_config
from trn_accum.plan import settings_run
from trn_accum.train.flops import flops_per_step
from trn_accum.train.trainer import Trainer


def run_case(case: dict, steps: int, warmup: int, peak: float) -> dict:
    """One case's row (see module docstring)."""
    # the trainer's own build: mesh, every "auto" resolved, the step, the data
    cfg = load_config(case["config"], case.get("set", []))
    trainer = Trainer.build(cfg, settings=settings_run.for_run)
    cfg = trainer.cfg
    row = {
        "accum_steps": cfg.trainer.accum_steps,
        "remat": cfg.model.remat,
        "attention": cfg.model.attention,
        "attention_block": cfg.model.attention_block,
        "loss_chunk": cfg.model.loss_chunk,
        "seq_len": cfg.data.seq_len,
        "global_batch": cfg.data.global_batch,
        "num_layers": cfg.model.num_layers,
        "hidden_dim": cfg.model.hidden_dim,
        "vocab_size": cfg.model.vocab_size,
    }
    start = time.perf_counter()
    compiled = trainer.program.compiled
    row["compile_s"] = round(time.perf_counter() - start, 2)
    row["memory"] = compiled_memory(compiled)
    row["footprint_bytes"] = footprint(row["memory"])
    state = trainer.init()
    batches = [trainer.batch(i) for i in (0, 1)]
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    kept = times[warmup:]
    row["step_times_s"] = [round(t, 5) for t in kept]
    row["median_step_s"] = statistics.median(kept)
    row["loss"] = float(metrics["loss"]) if "loss" in metrics else None
    row["mfu"] = flops_per_step(cfg)["total"] / row["median_step_s"] / peak
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    row.update({k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_limit")})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", help="JSON list of {name, config, set}")
    p.add_argument("--only", nargs="*", help="case names (default: all)")
    p.add_argument("--out", required=True, help="JSON lines, one per case, appended")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--platform", default="tpu-v5e", choices=sorted(platforms.PLATFORMS))
    args = p.parse_args(argv)
    with open(args.cases) as f:
        cases = json.load(f)
    peak = platforms.get(args.platform).peak_flops
    device = jax.devices()[0]
    for case in cases:
        if args.only and case["name"] not in args.only:
            continue
        row = {"name": case["name"], "config": case["config"], "set": case.get("set", [])}
        row.update(device=device.device_kind, jax_version=jax.__version__)
        try:
            row.update(run_case(case, args.steps, args.warmup, peak))
            shown = (
                f"{row['median_step_s']:.4f} s, MFU {row['mfu']:.3f}, footprint "
                f"{row['footprint_bytes']} B"
            )
        except Exception as e:  # a refusal (out of memory) is a row, not the end of the sweep
            message = str(e)
            row["error"] = message.strip().splitlines()[0][:400] if message.strip() else repr(e)
            asked = refused_bytes(message)
            if asked is not None:
                row["refused_bytes"] = asked
            shown = "error: " + row["error"][:200]
        print(f"{case['name']}: {shown}", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        jax.clear_caches()
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
