"""`trn-accum`: train | dry-run | neuron-check | neuron-env | prepare-data | plot | render-eks |
check-config | import-hf | export-hf | eval (trn_accum/interop/commands.py).

    trn-accum train --config FILE [--set section.key=value ...] [--run-dir DIR]
                    [--profile START:STOP] [--allow-config-change KEY ...]
    trn-accum dry-run --config FILE [--set ...] [--devices 64] [--nodes N] [--json]
                      [--no-step-time | --step-time-meshes NAME[,NAME...]]
    trn-accum neuron-check [--config FILE] [--run-dir DIR] [--json]   first thing on trn2
    trn-accum neuron-env                 the trn2 environment as shell `export` lines
    trn-accum prepare-data TEXT_FILES... --out DIR [--tokenizer bytes|tokenizer.json]
    trn-accum plot RUN_DIR [-o FILE.png]
    trn-accum render-eks --nodes N --image IMAGE [...]
    trn-accum check-config [--only-config-args] [--devices N] -- TRAIN_ARGS   what train refuses

Exit codes (`trn_accum.errors`): 0 success; 1 a check failed (dry-run blockers, a failing
neuron-check row) or a bug (with its traceback); 2 a user error (bad config, data, checkpoint,
launch environment or arguments: one line on stderr, no traceback; also a run dir owned by
another trainer, a resume that would
change the run's trajectory, or a run whose recent steps were all non-finite); 74 (EX_IOERR) a
checkpoint or the run's record could not be written (disk full, quota, permissions, a vanished
mount; the previous checkpoint is intact); 75 (EX_TEMPFAIL) preempted (SIGTERM/SIGINT) after
saving a checkpoint: run the same command again to resume.

`dry-run` needs N emulated CPU devices, which XLA fixes when its backend starts: this module
imports no JAX at the top, `main` sets `XLA_FLAGS` / the platform before any backend starts,
and if a backend is already running with another device count (e.g. `main` called inside a test
process) it re-runs itself in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

from trn_accum.analysis.platforms import PLATFORMS
from trn_accum.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UserError, one_line
from trn_accum.interop.commands import add_parsers

PROG = "trn-accum"

# XLA:CPU's concurrency-optimized scheduler may order collectives differently on different
# emulated devices, and the step then deadlocks in a rendezvous (seen on jax 0.10.2: the tiny
# config at accum_steps=2 hung in 3 of 3 runs within 30 steps; 0 of 4 with this flag).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
NEURON_CHECK_CPU_DEVICES = 8  # `neuron-check` off-Neuron: the rows on 8 emulated devices


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


class UsageError(UserError):
    """A bad command-line value: one line naming the value, the rule and a fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _profile_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) < int(m.group(2)):
        raise UsageError(
            f"--profile {text!r}: expected START:STOP with 1 <= START < STOP (step numbers as "
            "logged; traces steps START..STOP-1), e.g. --profile 10:15"
        )
    return int(m.group(1)), int(m.group(2))


# -- commands (JAX and the heavy modules are imported inside them, not at the top) -------------


def _cmd_train(args) -> int:
    profile = _profile_range(args.profile) if args.profile else None
    try:
        from trn_accum.train import loop
    except ImportError as e:  # a broken install on one node: its job's ranks hear of it
        from trn_accum.cluster.distributed import fail_startup

        fail_startup(UsageError(f"cannot import the trainer ({e}): reinstall trn_accum here"))

    run_dir = args.run_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0]
    )
    return loop.run(
        args.config,
        overrides=args.overrides,
        run_dir=run_dir,
        profile=profile,
        allow_config_change=args.allow_config_change,
    )


def _dry_run_env_ready(devices: int) -> bool:
    """Sets the CPU platform with `devices` devices if no JAX backend runs yet; else reports
    whether the running backend already has exactly that (CPU) device count."""
    jax = sys.modules.get("jax")
    if jax is not None:
        from jax._src import xla_bridge

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


# The dry-run emulates ONE node (its per-device batch for N nodes comes from --nodes), so more
# devices than 8 trn2.48xlarge at LNC=1 (8 x 128) buy nothing; XLA:CPU's emulated devices and
# the partitioned program grow with the count (--devices 99999999 passed 10 GB in 20 s).
MAX_DRY_RUN_DEVICES = 1024
# --nodes only divides the batch; the step-time model prices up to 128 nodes (its scale table).
MAX_DRY_RUN_NODES = 4096


def _mesh_names(text: str) -> tuple[str, ...]:
    """--step-time-meshes: comma-separated names of `recommend.MESHES`."""
    from trn_accum.analysis.recommend import MESHES

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in MESHES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: mesh names are {', '.join(MESHES)} (comma-separated)"
        )
    return names


def _cmd_dry_run(args) -> int:
    args.devices = args.devices or PLATFORMS[args.platform].devices_per_node
    if not 1 <= args.devices <= MAX_DRY_RUN_DEVICES:
        raise UsageError(
            f"--devices {args.devices}: must be 1..{MAX_DRY_RUN_DEVICES} (64 = one trn2.48xlarge "
            "at LNC=2); the dry-run emulates one node, --nodes N gives it the per-device batch "
            "of N nodes"
        )
    if args.nodes is not None and not 1 <= args.nodes <= MAX_DRY_RUN_NODES:
        raise UsageError(
            f"--nodes {args.nodes}: must be 1..{MAX_DRY_RUN_NODES} (the node count whose "
            "per-device batch one emulated node carries)"
        )
    if not _dry_run_env_ready(args.devices):
        # A backend with another device count runs in this process: start a fresh one (it sets
        # the device count in XLA_FLAGS before its backend starts).
        return subprocess.call([sys.executable, "-m", "trn_accum.cli", *args.argv])
    from trn_accum.plan import dryrun

    report = dryrun.run(
        args.config,
        overrides=args.overrides,
        devices=args.devices,
        nodes=args.nodes,
        step_time=args.step_time,
        step_time_meshes=args.step_time_meshes,
        platform_name=args.platform,
    )
    print(dryrun.format_report(report, as_json=args.json))
    return EXIT_FAILED if report.get("blockers") else EXIT_OK


def _cmd_neuron_check(args) -> int:
    from trn_accum.neuron import platform

    # Off-Neuron the same rows run on emulated CPU devices (the Neuron pieces as stand-ins).
    if not platform.neuron_available() and not _dry_run_env_ready(NEURON_CHECK_CPU_DEVICES):
        return subprocess.call([sys.executable, "-m", "trn_accum.cli", *args.argv])
    from trn_accum.cluster import distributed
    from trn_accum.plan import neuron_check

    distributed.initialize()  # multi-process jobs: the cross-process psum row
    report = neuron_check.run(args.config, overrides=args.overrides, run_dir=args.run_dir)
    print(neuron_check.format_report(report, as_json=args.json))
    return neuron_check.exit_code(report)


def _cmd_neuron_env(args) -> int:
    from trn_accum.neuron import platform

    for key, value in platform.trn2_env().items():
        print(f"export {key}={shlex.quote(value)}")
    return EXIT_OK


def _cmd_prepare_data(args) -> int:
    from trn_accum.train.prepare import prepare_data

    meta = prepare_data(args.text_files, args.out, args.tokenizer, binary_ok=args.binary_ok)
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']} documents, "
        f"{meta['dtype']}, vocab {meta['vocab_size']}) to {args.out}"
    )
    return EXIT_OK


def _cmd_plot(args) -> int:
    from trn_accum.train.metrics import plot_run

    print(plot_run(args.run_dir, args.out))
    return EXIT_OK


def check_train_args(train_args: list[str], *, only_config_args: bool = False):
    """(config path, Config): what `trn-accum train TRAIN_ARGS` refuses in its parser and config
    loader, refused now (one line, exit 2). only_config_args: read only --config and --set (the
    rest belong to a substituted trainer, e.g. the Slurm script's TRN_ACCUM_TRAIN)."""
    from trn_accum.train.config import load_config

    if only_config_args:
        parser = _Parser(prog=f"{PROG} train")
        _config_args(parser)
        args, _ = parser.parse_known_args(train_args)
    else:
        args = build_parser().parse_args(["train", *train_args])
    return args.config, load_config(args.config, args.overrides)  # ConfigError: as train's


def _cmd_check_config(args) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    config, cfg = check_train_args(train_args, only_config_args=args.only_config_args)
    overrides = sum(a == "--set" or a.startswith("--set=") for a in train_args)
    where = "; mesh and batch split not checked (pass --devices N)"
    if args.devices or not (args.only_config_args or os.environ.get("SLURM_JOB_ID")):
        from trn_accum.train import step

        where = f" on {step.check_start(cfg, args.devices)} devices"  # as `train` at start
    print(f"{PROG} check-config: {config} with {overrides} --set override(s): ok{where}")
    return EXIT_OK


def _check_rendered_job(args, train_args: list[str]) -> None:
    """What every pod would refuse, refused now (one line, exit 2): the config with its --set
    overrides through the trainer's own loader (the path is the image's, relative to the
    repository: read from this checkout), the --train-arg values through the train parser,
    and a run directory outside the checkpoint volume unless accepted explicitly."""
    from trn_accum.cluster import eks

    if not os.path.isfile(args.config):
        raise UsageError(
            f"render-eks --config {args.config}: no such file in this checkout; the path is the "
            "image's, relative to the repository: render from the repository root of the "
            "revision the image was built from"
        )
    check_train_args(["--config", args.config, *train_args])
    run_dir = args.run_dir
    mount = eks.CHECKPOINT_MOUNT
    if run_dir is not None and not args.run_dir_outside_volume:
        norm = os.path.normpath(run_dir)
        if not os.path.isabs(run_dir) or os.path.commonpath([norm, mount]) != mount:
            raise UsageError(
                f"render-eks --run-dir {run_dir}: not under the checkpoint volume's mount {mount}"
                f" (the --pvc claim), so a pod restart loses every checkpoint; use "
                f"--run-dir {mount}/<name>, or pass --run-dir-outside-volume to accept that"
            )


def _cmd_render_eks(args) -> int:
    from trn_accum.cluster import eks

    train_args = [a for kv in args.set for a in ("--set", kv)] + list(args.train_arg)
    _check_rendered_job(args, train_args)
    text = eks.render_eks(
        args.nodes,
        args.image,
        args.config,
        name=args.name,
        namespace=args.namespace,
        pvc=args.pvc,
        run_dir=args.run_dir,
        train_args=train_args,
        max_restarts=args.max_restarts,
        scheduler_name=args.scheduler_name,
        neuron_check=args.neuron_check,
        socket_ifname=args.socket_ifname or eks.SOCKET_IFNAME,
    )
    if args.output == "-":
        sys.stdout.write(text)
        return EXIT_OK
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise eks.RenderError(f"-o {args.output!r}: cannot write ({e.strerror})") from None
    return EXIT_OK


# -- the parser --------------------------------------------------------------------------------


def _config_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override a config value (repeatable), e.g. --set trainer.steps=20",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Gradient accumulation and Fuji training for trn2 / CPU.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    t = sub.add_parser("train", help="train (or resume) a run")
    _config_args(t)
    t.add_argument("--run-dir", metavar="DIR", help="checkpoints + metrics (default runs/CONFIG)")
    t.add_argument(
        "--profile",
        metavar="START:STOP",
        help="jax.profiler trace of steps START..STOP-1 into RUN_DIR/profile",
    )
    t.add_argument(
        "--allow-config-change",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY",
        help="resume although these trajectory keys (section.key, or a whole section) differ "
        "from the run's record; the change is logged in RUN_DIR/config_changes.jsonl",
    )
    t.set_defaults(func=_cmd_train)

    d = sub.add_parser("dry-run", help="compile the real train step on emulated CPU devices")
    _config_args(d)
    d.add_argument(
        "--devices", type=int, default=None, help="emulated devices (default: a node of --platform)"
    )
    d.add_argument(
        "--platform", default="trn2", choices=tuple(PLATFORMS), help="what the step time prices"
    )
    d.add_argument(
        "--nodes", type=int, default=None, help="node count whose per-device batch to emulate"
    )
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument(
        "--step-time",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the trn2 step-time model: bytes by link, step time / MFU bounds for the config "
        "and candidates, a recommendation (default on; a few minutes more for the 3B config on "
        "2 cores; --no-step-time skips it)",
    )
    d.add_argument(
        "--step-time-meshes",
        type=_mesh_names,
        default=None,
        metavar="NAME[,NAME...]",
        help="price only these candidate meshes (default every one of "
        "trn_accum.analysis.recommend.MESHES: hybrid, hybrid-m2, hybrid-m1, reference)",
    )
    d.set_defaults(func=_cmd_dry_run)

    nc = sub.add_parser(
        "neuron-check",
        help="prove each risky trn2 piece on this node in minutes (run it on your first node)",
    )
    nc.add_argument(
        "--config", default="configs/fuji-3b-trn2.toml", metavar="FILE", help="TOML config"
    )
    nc.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides"
    )
    nc.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where the checkpoint row writes (default $TRN_ACCUM_RUN_DIR, else runs/neuron-check)",
    )
    nc.add_argument("--json", action="store_true", help="print the report as JSON")
    nc.set_defaults(func=_cmd_neuron_check)

    ne = sub.add_parser(
        "neuron-env",
        help="print the trn2 environment as shell exports (launch/env/trn2.sh evaluates it)",
    )
    ne.set_defaults(func=_cmd_neuron_env)

    pd = sub.add_parser("prepare-data", help="tokenize text files into a token directory")
    pd.add_argument("text_files", nargs="+", metavar="TEXT_FILE")
    pd.add_argument("--out", required=True, metavar="DIR")
    pd.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json path")
    pd.add_argument("--binary-ok", action="store_true", help="tokenize archives/binary too")
    pd.set_defaults(func=_cmd_prepare_data)

    pl = sub.add_parser("plot", help="plot loss, learning rate and gradient norm of a run")
    pl.add_argument("run_dir", metavar="RUN_DIR")
    pl.add_argument("-o", "--out", metavar="FILE.png", default=None)
    pl.set_defaults(func=_cmd_plot)

    cc = sub.add_parser(
        "check-config",
        help="refuse now what `trn-accum train ARGS` would refuse at start (the train parser, "
        "the config with its --set overrides); the Slurm script runs it before srun",
    )
    cc.add_argument(
        "--only-config-args",
        action="store_true",
        help="read only --config and --set from ARGS (the rest belong to another trainer)",
    )
    cc.add_argument("--devices", type=int, help="the job's device count (default: JAX's here)")
    cc.add_argument(
        "train_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="the train arguments"
    )
    cc.set_defaults(func=_cmd_check_config)

    r = sub.add_parser(
        "render-eks", help="write the EKS manifests (headless Service + Indexed Job) for N nodes"
    )
    r.add_argument("--nodes", type=int, required=True, help="trn2.48xlarge nodes (= pods)")
    r.add_argument("--image", required=True, help="the Dockerfile's neuron stage, pushed")
    r.add_argument(
        "--config", default="configs/fuji-3b-trn2.toml", help="config path inside the image"
    )
    r.add_argument("--name", default="fuji-3b", help="Job/Service name (DNS label)")
    r.add_argument("--namespace", default="default")
    r.add_argument("--pvc", default="trn-accum-fsx", help="shared-FS PersistentVolumeClaim")
    r.add_argument(
        "--run-dir", default=None, help="default /checkpoints/<name>; must be under /checkpoints"
    )
    r.add_argument(
        "--run-dir-outside-volume",
        action="store_true",
        help="accept a --run-dir outside the checkpoint volume: a pod restart loses checkpoints",
    )
    r.add_argument("--max-restarts", type=int, default=3, help="whole-job restarts on crashes")
    r.add_argument("--scheduler-name", default=None, help="pod schedulerName (optional)")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to `trn-accum train --set` (repeatable)",
    )
    r.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="any extra `trn-accum train` argument, verbatim (repeatable; use --train-arg=-x)",
    )
    r.add_argument(
        "--neuron-check",
        action="store_true",
        help="each pod runs `trn-accum neuron-check` first; a failing row fails the Job",
    )
    r.add_argument(
        "--socket-ifname",
        default=None,
        metavar="IFNAME",
        help="CCOM_SOCKET_IFNAME of the pods (default eth0, the pod's interface)",
    )
    r.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    r.set_defaults(func=_cmd_render_eks)
    add_parsers(sub)  # import-hf, export-hf, eval
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trn-accum`. Returns the exit code (also used by `python -m`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu_fallback_flags()
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
