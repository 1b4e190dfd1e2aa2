"""`trn-accum train` and `trn-accum check-config`: a run, and what `train` refuses at start,
refused before one (the Slurm script runs check-config before srun; render-eks uses it too)."""

from __future__ import annotations

import argparse
import os
import re

from trn_accum.cli import emulated_cpu
from trn_accum.cli.parsing import PROG, Parser, UsageError, config_args
from trn_accum.errors import EXIT_OK, UserError


def _profile_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) < int(m.group(2)):
        raise UsageError(
            f"--profile {text!r}: expected START:STOP with 1 <= START < STOP (step numbers as "
            "logged; traces steps START..STOP-1), e.g. --profile 10:15"
        )
    return int(m.group(1)), int(m.group(2))


def _cmd_train(args) -> int:
    profile = _profile_range(args.profile) if args.profile else None
    try:
        from trn_accum.plan import settings_run
        from trn_accum.train import loop
    except ImportError as e:  # a broken install on one node: its job's ranks hear of it
        from trn_accum.cluster.distributed import fail_startup

        fail_startup(UsageError(f"cannot import the trainer ({e}): reinstall trn_accum here"))

    run_dir = args.run_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(args.config))[0]
    )
    code = _emulate_for(args.config, args.overrides, args.argv)
    if code is not None:  # the command ran in a fresh process
        return code
    made = _missing_dirs(run_dir)
    try:
        return loop.run(
            args.config,
            overrides=args.overrides,
            run_dir=run_dir,
            profile=profile,
            allow_config_change=args.allow_config_change,
            settings=settings_run.for_run,
        )
    except BaseException:  # a refused start leaves no empty run dir behind
        _remove_empty(made)
        raise


def _emulate_for(config: str, overrides, argv: list[str]) -> int | None:
    """The CPU fallback's devices for the config's mesh (`emulated_cpu.emulate_for_config`);
    a config that does not load changes nothing here (the trainer names what is wrong)."""
    from trn_accum.config.load import load_config

    try:
        cfg = load_config(config, overrides)
    except UserError:
        return None
    return emulated_cpu.emulate_for_config(cfg, argv)


def _missing_dirs(path: str) -> list[str]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    made = []
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        made.append(path)
        path = os.path.dirname(path)
    return made


def _remove_empty(dirs: list[str]) -> None:
    """Removes the directories of `dirs` (deepest first) while they are empty; never a file."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:  # not empty (or not there): keep it and its parents
            return


def add_train_args(t: argparse.ArgumentParser) -> None:
    """The arguments of `trn-accum train`."""
    config_args(t)
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


def train_parser() -> Parser:
    """`trn-accum train`'s parser on its own (what check-config parses TRAIN_ARGS with)."""
    t = Parser(prog=f"{PROG} train")
    add_train_args(t)
    return t


def check_train_args(train_args: list[str], *, only_config_args: bool = False):
    """(config path, Config): what `trn-accum train TRAIN_ARGS` refuses in its parser and config
    loader, refused now (one line, exit 2). only_config_args: read only --config and --set (the
    rest belong to a substituted trainer, e.g. the Slurm script's TRN_ACCUM_TRAIN)."""
    from trn_accum.config.load import load_config

    if only_config_args:
        parser = Parser(prog=f"{PROG} train")
        config_args(parser)
        args, _ = parser.parse_known_args(train_args)
    else:
        args = train_parser().parse_args(train_args)
    return args.config, load_config(args.config, args.overrides)  # ConfigError: as train's


def _cmd_check_config(args) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    config, cfg = check_train_args(train_args, only_config_args=args.only_config_args)
    overrides = sum(a == "--set" or a.startswith("--set=") for a in train_args)
    where = "; mesh and batch split not checked (pass --devices N)"
    if args.devices or not (args.only_config_args or os.environ.get("SLURM_JOB_ID")):
        if not args.devices:  # this process's devices: the CPU fallback's for the mesh
            code = emulated_cpu.emulate_for_config(cfg, args.argv)
            if code is not None:
                return code
        from trn_accum.config import mesh_rules

        where = f" on {mesh_rules.check_start(cfg, args.devices)} devices"  # as `train` at start
    print(f"{PROG} check-config: {config} with {overrides} --set override(s): ok{where}")
    if args.settings:
        print(_settings_line(cfg, args.settings, args.devices))
    return EXIT_OK


def _settings_line(cfg, platform_name: str, devices: int | None) -> str:
    """The "train will run" line of `cfg` on `platform_name` nodes of `devices` (default the
    platform's node) devices: the settings search train and dry-run run (any "auto" priced)."""
    import sys

    from trn_accum.analysis.platforms import PLATFORMS
    from trn_accum.plan import settings_run
    from trn_accum.plan.settings import Target

    per_node = devices or PLATFORMS[platform_name].devices_per_node
    target = Target(platform_name, per_node, cfg.mesh.nodes)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    return settings_run.resolve(cfg, target, say=say).line()


def add_parsers(sub) -> None:
    """Adds `train` and `check-config` to the subparsers action `sub`."""
    t = sub.add_parser("train", help="train (or resume) a run")
    add_train_args(t)
    t.set_defaults(func=_cmd_train)

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
        "--settings",
        metavar="PLATFORM",
        choices=("trn2", "trn1", "tpu-v5e"),
        help="also print the settings train will run on PLATFORM's nodes (of --devices devices): "
        'the settings search for any "auto" (minutes for a large model)',
    )
    cc.add_argument(
        "train_args", nargs=argparse.REMAINDER, metavar="-- ARGS", help="the train arguments"
    )
    cc.set_defaults(func=_cmd_check_config)
