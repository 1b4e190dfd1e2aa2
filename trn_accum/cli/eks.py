"""`trn-accum render-eks`: the EKS manifests for N nodes, after refusing what every pod would
refuse (the config and train arguments through `train`'s own checks)."""

from __future__ import annotations

import os
import sys

from trn_accum.cli.parsing import UsageError
from trn_accum.cli.run import check_train_args
from trn_accum.errors import EXIT_OK


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


def add_parsers(sub) -> None:
    """Adds `render-eks` to the subparsers action `sub`."""
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
