"""`trn-accum`: train | dry-run | prepare-data | plot | render-eks.

    trn-accum train --config FILE [--set section.key=value ...] [--run-dir DIR]
                    [--profile START:STOP]
    trn-accum dry-run --config FILE [--set ...] [--devices 64] [--nodes N] [--json]
    trn-accum prepare-data TEXT_FILES... --out DIR [--tokenizer bytes|tokenizer.json]
    trn-accum plot RUN_DIR [-o FILE.png]
    trn-accum render-eks ...          (see `trn-accum render-eks --help`)

Exit codes: 0 success; 2 a user error (bad config, data, checkpoint, launch environment or
arguments: one line on stderr, no traceback); 75 (EX_TEMPFAIL) the run was preempted
(SIGTERM/SIGINT) after saving a checkpoint: restart the same command to resume; 1 a bug
(traceback).

`dry-run` needs N emulated CPU devices, which XLA fixes when its backend starts: this module
imports no JAX at the top, `main` sets `XLA_FLAGS` / the platform before any backend starts,
and if a backend is already running with another device count (e.g. `main` called inside a test
process) it re-runs itself in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # trn_accum.checkpoint.EXIT_PREEMPTED (EX_TEMPFAIL); kept equal by a test
PROG = "trn-accum"


# XLA:CPU's concurrency-optimized scheduler may order collectives differently on different
# emulated devices, and the step then deadlocks in a rendezvous (seen on jax 0.10.2: the tiny
# config at accum_steps=2 hung in 3 of 3 runs within 30 steps; 0 of 4 with this flag).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def cpu_fallback_flags(environ=os.environ) -> None:
    """Adds `CPU_XLA_FLAGS` to XLA_FLAGS when this process runs on the CPU fallback
    (JAX_PLATFORMS starting with cpu, or emulated host devices), before JAX starts; a flag
    the user already set wins. Never touches a Neuron run."""
    flags = environ.get("XLA_FLAGS", "")
    on_cpu = environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu"
    if not (on_cpu or "--xla_force_host_platform_device_count" in flags):
        return
    for flag in CPU_XLA_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    environ["XLA_FLAGS"] = flags


class UsageError(ValueError):
    """A bad command-line value: one line naming the value, the rule and a fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the user gave something wrong" (exit 2, one line)."""
    types: list[type[BaseException]] = [UsageError]
    for module, name in (
        ("trn_accum.config", "ConfigError"),
        ("trn_accum.data", "DataError"),
        ("trn_accum.checkpoint", "CheckpointError"),
        ("trn_accum.distributed", "LaunchError"),
        ("trn_accum.eks", "LaunchError"),
        ("trn_accum.eks", "RenderError"),
        ("trn_accum.train", "TrainError"),
        ("trn_accum.dryrun", "DryRunError"),
        ("trn_accum.metrics", "PlotError"),
        ("trn_accum.neuron", "NeuronError"),
    ):
        mod = sys.modules.get(module)
        t = getattr(mod, name, None) if mod is not None else None
        if isinstance(t, type) and issubclass(t, BaseException):
            types.append(t)
    return tuple(types)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _profile_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) < int(m.group(2)):
        raise UsageError(
            f"--profile {text!r}: expected START:STOP with 1 <= START < STOP (step numbers as "
            "logged; traces steps START..STOP-1), e.g. --profile 10:15"
        )
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Gradient accumulation and Fuji training for trn2 / CPU.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def config_args(sp):
        sp.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            dest="overrides",
            help="override a config value (repeatable), e.g. --set trainer.steps=20",
        )

    t = sub.add_parser("train", help="train (or resume) a run")
    config_args(t)
    t.add_argument("--run-dir", metavar="DIR", help="checkpoints + metrics (default runs/CONFIG)")
    t.add_argument(
        "--profile",
        metavar="START:STOP",
        help="jax.profiler trace of steps START..STOP-1 into RUN_DIR/profile",
    )

    d = sub.add_parser("dry-run", help="compile the real train step on emulated CPU devices")
    config_args(d)
    d.add_argument(
        "--devices", type=int, default=64, help="emulated devices (default 64: one trn2.48xlarge)"
    )
    d.add_argument(
        "--nodes", type=int, default=None, help="node count whose per-device batch to emulate"
    )
    d.add_argument("--json", action="store_true", help="print the report as JSON")

    pd = sub.add_parser("prepare-data", help="tokenize text files into a token directory")
    pd.add_argument("text_files", nargs="+", metavar="TEXT_FILE")
    pd.add_argument("--out", required=True, metavar="DIR")
    pd.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")

    pl = sub.add_parser("plot", help="plot loss, learning rate and gradient norm of a run")
    pl.add_argument("run_dir", metavar="RUN_DIR")
    pl.add_argument("-o", "--out", metavar="FILE.png", default=None)

    sub.add_parser("render-eks", help="render Kubernetes manifests (trn_accum.eks)", add_help=False)
    return p


# -- commands --------------------------------------------------------------------------------


def _cmd_train(args) -> int:
    profile = _profile_range(args.profile) if args.profile else None
    from trn_accum import train  # noqa: PLC0415 (JAX is imported here, not at the top)

    run_dir = args.run_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0]
    )
    return train.run(args.config, overrides=args.overrides, run_dir=run_dir, profile=profile)


def _dry_run_env_ready(devices: int) -> bool:
    """Sets the CPU platform with `devices` devices if no JAX backend runs yet; else reports
    whether the running backend already has exactly that (CPU) device count."""
    jax = sys.modules.get("jax")
    if jax is not None:
        from jax._src import xla_bridge  # noqa: PLC0415

        if xla_bridge.backends_are_initialized():
            return jax.default_backend() == "cpu" and jax.device_count() == devices
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    cpu_fallback_flags()
    if jax is not None:
        jax.config.update("jax_platforms", "cpu")
    return True


def _cmd_dry_run(args, argv) -> int:
    if args.devices < 1:
        raise UsageError(f"--devices {args.devices}: must be >= 1 (64 = one trn2.48xlarge)")
    if args.nodes is not None and args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes}: must be >= 1")
    if not _dry_run_env_ready(args.devices):
        # A backend with another device count runs in this process: start a fresh one (it sets
        # the device count in XLA_FLAGS before its backend starts).
        return subprocess.call([sys.executable, "-m", "trn_accum.cli", *argv])
    from trn_accum import dryrun  # noqa: PLC0415

    report = dryrun.run(
        args.config, overrides=args.overrides, devices=args.devices, nodes=args.nodes
    )
    print(dryrun.format_report(report, as_json=args.json))
    return 1 if report.get("blockers") else 0


def _cmd_prepare_data(args) -> int:
    from trn_accum.data import prepare_data  # noqa: PLC0415

    meta = prepare_data(args.text_files, args.out, tokenizer=args.tokenizer)
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']} documents, "
        f"{meta['dtype']}, vocab {meta['vocab_size']}) to {args.out}"
    )
    return 0


def _cmd_plot(args) -> int:
    from trn_accum.metrics import plot_run  # noqa: PLC0415

    print(plot_run(args.run_dir, args.out))
    return 0


def _cmd_render_eks(rest) -> int:
    try:
        from trn_accum import eks  # noqa: PLC0415
    except ImportError as e:
        raise UsageError(f"render-eks is not available in this install ({e})") from None
    return int(eks.main(list(rest)) or 0)


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "render-eks":
        return _cmd_render_eks(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _cmd_train(args)
    if args.command == "dry-run":
        return _cmd_dry_run(args, argv)
    if args.command == "prepare-data":
        return _cmd_prepare_data(args)
    if args.command == "plot":
        return _cmd_plot(args)
    raise UsageError(f"unknown command {args.command!r}")  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trn-accum`. Returns the exit code (also used by `python -m`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu_fallback_flags()
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, _user_error_types()):
            print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
