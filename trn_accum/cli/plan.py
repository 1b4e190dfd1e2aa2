"""`trn-accum dry-run`, `neuron-check` and `neuron-env`: the step compiled without training it,
the trn2 pieces proved on a node, and the trn2 environment as shell exports."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from trn_accum.analysis.platforms import PLATFORMS
from trn_accum.cli.emulated_cpu import emulate_cpu_devices
from trn_accum.cli.parsing import UsageError, config_args
from trn_accum.errors import EXIT_FAILED, EXIT_OK

NEURON_CHECK_CPU_DEVICES = 8  # `neuron-check` off-Neuron: the rows on 8 emulated devices

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
    if args.devices is None:  # 0 is a value (refused below), not "the default"
        args.devices = PLATFORMS[args.platform].devices_per_node
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
    # the dry-run reads partitioned modules, not XLA:CPU's code: its codegen optimizations go
    from trn_accum.analysis.hlo.partitioned import PRICING_FLAGS

    if not emulate_cpu_devices(args.devices, PRICING_FLAGS):
        # A backend with another device count runs in this process: start a fresh one (it sets
        # the device count in XLA_FLAGS before its backend starts).
        return subprocess.call([sys.executable, "-m", "trn_accum.cli", *args.argv])
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    from trn_accum.plan import dryrun

    report = dryrun.run(
        args.config,
        overrides=args.overrides,
        devices=args.devices,
        nodes=args.nodes,
        step_time=args.step_time,
        step_time_meshes=args.step_time_meshes,
        search=args.search,
        platform_name=args.platform,
        say=say,
    )
    print(dryrun.format_report(report, as_json=args.json))
    return EXIT_FAILED if report.get("blockers") else EXIT_OK


def _cmd_neuron_check(args) -> int:
    from trn_accum.neuron import platform

    # Off-Neuron the same rows run on emulated CPU devices (the Neuron pieces as stand-ins).
    if not platform.neuron_available() and not emulate_cpu_devices(NEURON_CHECK_CPU_DEVICES):
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


def add_parsers(sub) -> None:
    """Adds `dry-run`, `neuron-check` and `neuron-env` to the subparsers action `sub`."""
    d = sub.add_parser("dry-run", help="compile the real train step on emulated CPU devices")
    config_args(d)
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
        help="the step-time model of the config: bytes by link, step time and MFU bounds, "
        "the predicted step (default on; --no-step-time skips it)",
    )
    d.add_argument(
        "--search",
        action="store_true",
        help="also price candidate meshes, k and reduce beside the config, recommend one and "
        "print the weak-scaling table (minutes: 686 s for the 3B config on 2 cores)",
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
