"""Measured step times of our trainer on one accelerator chip: the rows the step-time model is
fitted on and checked against (issue 35, `benchmarks/measured-tpu-v5e.json`).

    python3 benchmarks/measure_tpu.py                      # every configs/calibration/tpu-v5e-*
    python3 benchmarks/measure_tpu.py --only configs/calibration/tpu-v5e-k1-plain-lc0.toml

On a TPU v5e machine, from the repository root, with the package importable (PYTHONPATH=.) and
JAX_PLATFORMS unset (the Makefile's cpu would put the run on the host). Each config runs in a
process of its own, exactly as

    python3 -m trn_accum.cli train --config CONFIG --run-dir RUN_DIR

with a thread beside the trainer that, once the config's last step is in RUN_DIR/metrics.jsonl,
reads the chip's peak memory (`jax.local_devices()[0].memory_stats()`) and ends the process: the
final checkpoint save (7 GB and more here) is neither timed nor needed. A row: the trainer's own
`step_time_s` per step (wall time from the end of one step to the end of the next, metrics
fetched), its median, min and max over the steps after `--warmup` (the first step after the
compile runs slower), the compile time the trainer printed, and the peak bytes. A config that
fails (out of chip memory, say) gives a row with its last error line instead of times. Rows are
merged into `--out` by config path, so a subset can be re-run.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_OUT = "benchmarks/measured-tpu-v5e.json"
DEFAULT_GLOB = "configs/calibration/tpu-v5e-*.toml"
DEVICE_FILE = "device.json"  # written by the child: peak memory, device kind
NOTES = {
    "setup": (
        "on the TPU v5e machine (JAX 0.10.2 preinstalled, no network): PIP_CONFIG_FILE=/dev/null "
        "python3 -m pip install --isolated --only-binary=:all: --index-url "
        "file:///opt/pypi/simple --target /tmp/site optax orbax-checkpoint pyyaml; export "
        "PYTHONPATH=$PYTHONPATH:/tmp/site:REPO_ROOT; unset JAX_PLATFORMS; then each row's "
        "command from the repository root"
    ),
    "step_time_s": (
        "the trainer's metrics.jsonl step_time_s: wall time from the end of one step to the end "
        "of the next (metrics fetched to the host); median/min/max over the steps after "
        "warmup_steps"
    ),
    "peak_bytes_in_use": (
        "memory_stats() of the chip after the last step, as reported: it grows by the state of "
        "one layer (12 B per parameter) from 2 to 3 layers and is the same at every k, "
        "attention and loss_chunk, so it counts the buffers (parameters, Adam state) and not "
        "the compiled step's temporaries: no measure of the step's peak"
    ),
}
COMPILED = re.compile(r"compiled the train step in ([0-9.]+) s")


def train_argv(config: str, run_dir: str) -> list[str]:
    """The trainer's command line for one row (what the child process runs in itself)."""
    return ["train", "--config", config, "--run-dir", run_dir]


def steady_stats(step_times: list[float], warmup: int) -> dict:
    """Median, min and max of the step times after the first `warmup` steps.

    step_times: seconds, in step order (step 1 first). ValueError when none are left."""
    kept = step_times[warmup:]
    if not kept:
        raise ValueError(f"{len(step_times)} steps, none left after warmup {warmup}")
    return {
        "median_step_s": statistics.median(kept),
        "min_step_s": min(kept),
        "max_step_s": max(kept),
        "steps_counted": len(kept),
        "steps_dropped": warmup,
    }


# ---------------------------------------------------------------------------------------------
# The child: the trainer in this process, a watcher thread that ends it after the last step


def _record_device(run_dir: str) -> None:
    """RUN_DIR/device.json: the chip's peak and limit bytes so far, its kind and platform."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    found = {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_limit")}
    found.update(device_kind=device.device_kind, platform=device.platform)
    with open(os.path.join(run_dir, DEVICE_FILE), "w") as f:
        json.dump(found, f)


def _watch(run_dir: str, steps: int) -> None:
    from trn_accum.train.metrics import MetricsError, read_metrics

    path = os.path.join(run_dir, "metrics.jsonl")
    while True:
        time.sleep(0.2)
        try:
            done = os.path.exists(path) and any(
                r["step"] >= steps for r in read_metrics(path) if r.get("kind") == "train"
            )
        except MetricsError:
            done = False
        if done:
            _record_device(run_dir)
            sys.stdout.flush()
            os._exit(0)


def child(config: str, run_dir: str) -> int:
    """Runs `trn-accum train` in this process; exits 0 once the last step is logged."""
    from trn_accum.cli import main
    from trn_accum.config.load import load_config

    steps = load_config(config).trainer.steps
    threading.Thread(target=_watch, args=(run_dir, steps), daemon=True).start()
    code = main(train_argv(config, run_dir))
    if code == 0:  # finished (final save included) before the watcher's next look
        _record_device(run_dir)
    return code


# ---------------------------------------------------------------------------------------------
# The parent: one child per config, one row per child


def _row(config: str, run_dir: str, proc: subprocess.CompletedProcess, warmup: int) -> dict:
    from trn_accum.analysis import platforms
    from trn_accum.config.load import load_config
    from trn_accum.train.flops import flops_per_step
    from trn_accum.train.metrics import read_metrics

    cfg = load_config(config)
    row = {
        "config": config,
        "command": f"python3 benchmarks/measure_tpu.py --only {config}",
        "train_command": "python3 -m trn_accum.cli " + shlex.join(train_argv(config, "RUN_DIR")),
        "num_layers": cfg.model.num_layers,
        "accum_steps": cfg.trainer.accum_steps,
        "attention": cfg.model.attention,
        "loss_chunk": cfg.model.loss_chunk,
        "seq_len": cfg.data.seq_len,
        "global_batch": cfg.data.global_batch,
        "tokens_per_step": cfg.data.seq_len * cfg.data.global_batch,
    }
    metrics = os.path.join(run_dir, "metrics.jsonl")
    times = []
    if os.path.exists(metrics):
        recs = [r for r in read_metrics(metrics) if r.get("kind") == "train"]
        times = [r["step_time_s"] for r in sorted(recs, key=lambda r: r["step"])]
    compiled = COMPILED.search(proc.stdout)
    row["compile_s"] = float(compiled.group(1)) if compiled else None
    if proc.returncode != 0 or len(times) <= warmup:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        row["error"] = f"exit {proc.returncode}: " + (lines[-1] if lines else "no output")
        row["step_times_s"] = times
        return row
    row.update(steady_stats(times, warmup))
    row["step_times_s"] = times
    peak = platforms.get("tpu-v5e").peak_flops
    row["mfu"] = flops_per_step(cfg)["total"] / row["median_step_s"] / peak
    saved = os.path.join(run_dir, "config.json")  # the run's config, every "auto" resolved
    if os.path.exists(saved):
        with open(saved) as f:
            ran = json.load(f)
        row["resolved"] = {
            "accum_steps": ran["trainer"]["accum_steps"],
            "remat": ran["model"]["remat"],
            "loss_chunk": ran["model"]["loss_chunk"],
        }
    device_file = os.path.join(run_dir, DEVICE_FILE)
    if os.path.exists(device_file):
        with open(device_file) as f:
            row.update(json.load(f))
    return row


def measure(config: str, warmup: int, timeout: float) -> dict:
    """One config in a child process (see the module docstring); its row."""
    with tempfile.TemporaryDirectory(prefix="measure-") as tmp:
        run_dir = os.path.join(tmp, "run")
        argv = [sys.executable, os.path.abspath(__file__), "--child", config, run_dir]
        start = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
            proc = subprocess.CompletedProcess(
                argv, -9, out, err + f"\ntimed out after {timeout} s"
            )
        row = _row(config, run_dir, proc, warmup)
        row["process_s"] = round(time.perf_counter() - start, 1)
        return row


def merge(old: dict, rows: list[dict]) -> dict:
    """`old`'s rows with those of the same config replaced by `rows`, in config order."""
    by_config = {r["config"]: r for r in old.get("rows", [])}
    by_config.update({r["config"]: r for r in rows})
    return {**old, "rows": [by_config[c] for c in sorted(by_config)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="config files (default: all calibration ones)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per config")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child)

    import jax  # the version only: this process never opens the chip (one process at a time)

    configs = args.only or sorted(glob.glob(DEFAULT_GLOB))
    rows = []
    for config in configs:
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        row = {**measure(config, args.warmup, args.timeout), "jax_version": jax.__version__}
        row["date"] = date
        rows.append(row)
        shown = row.get("error") or (
            f"median {row['median_step_s']:.4f} s (min {row['min_step_s']:.4f}, max "
            f"{row['max_step_s']:.4f}, {row['steps_counted']} steps), compile "
            f"{row['compile_s']} s, peak {row.get('peak_bytes_in_use')}"
        )
        print(f"{config}: {shown}", flush=True)
        _write(args.out, rows, args.warmup)  # after every row: a run cut short keeps its rows
    return 0


def _write(path: str, rows: list[dict], warmup: int) -> None:
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    result = merge({**old, "warmup_steps": warmup, "notes": NOTES}, rows)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
