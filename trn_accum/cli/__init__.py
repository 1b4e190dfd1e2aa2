"""`trn-accum`: train | dry-run | neuron-check | neuron-env | prepare-data | plot | render-eks |
check-config | import-hf | export-hf | eval (trn_accum/interop/commands.py).

    trn-accum train --config FILE [--set section.key=value ...] [--run-dir DIR]
                    [--profile START:STOP] [--allow-config-change KEY ...]
    trn-accum dry-run --config FILE [--set ...] [--devices 64] [--nodes N] [--json]
                      [--no-step-time | --step-time-meshes NAME[,NAME...]]
    trn-accum neuron-check [--config FILE] [--run-dir DIR] [--json]   first thing on trn2
    trn-accum neuron-env                 the trn2 environment as shell `export` lines
    trn-accum prepare-data FILES... --out DIR [--tokenizer bytes|tokenizer.json] [--workers N]
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
saving a checkpoint: run the same command again to resume; 141 (128 + SIGPIPE) stdout's
reader went away (`| head`), nothing printed.

`dry-run` (and `neuron-check` off Neuron) need N emulated CPU devices, which XLA fixes when its
backend starts: `cli/emulated_cpu.py` sets `XLA_FLAGS` and the platform before asking the
backend, and where one already runs with another device count (e.g. `main` called inside a test
process) the command re-runs itself in a subprocess. Each subcommand lives in the module that
runs it: `cli/run.py` (train, check-config), `cli/plan.py` (dry-run, neuron-check, neuron-env),
`cli/data.py` (prepare-data, plot), `cli/eks.py` (render-eks), `interop/commands.py`.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from trn_accum.cli import data, eks, plan, run
from trn_accum.cli.emulated_cpu import CPU_XLA_FLAGS, cpu_fallback_flags, emulate_for_run_dir
from trn_accum.cli.parsing import PROG, Parser, UsageError
from trn_accum.cli.run import check_train_args
from trn_accum.errors import EXIT_INTERRUPTED, UserError, one_line
from trn_accum.interop.commands import add_parsers as add_interop_parsers

EXIT_STDOUT_CLOSED = 128 + signal.SIGPIPE  # as a shell shows a process that SIGPIPE killed

__all__ = [
    "CPU_XLA_FLAGS",
    "PROG",
    "UsageError",
    "build_parser",
    "check_train_args",
    "cpu_fallback_flags",
    "main",
]


def build_parser() -> Parser:
    """`trn-accum` and its subcommands, each registered by the module that runs it."""
    p = Parser(prog=PROG, description="Gradient accumulation and Fuji training for trn2 / CPU.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for module in (run, plan, data, eks):
        module.add_parsers(sub)
    add_interop_parsers(sub)  # import-hf, export-hf, eval
    return p


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a pipe closed early, as by `| head -n 0`): its
    descriptor polls as an error."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (a replaced sys.stdout)
        return False


def _stdout_gone() -> int:
    """Ends a command whose stdout's reader has gone as a program killed by SIGPIPE shows it
    (128 + SIGPIPE): stdout points at /dev/null so the interpreter's last flush of what is
    still buffered succeeds, and nothing is printed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


def main(argv: list[str] | None = None) -> int:
    """Entry point of `trn-accum`. Returns the exit code (also used by `python -m`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cpu_fallback_flags()
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        if args.command == "eval":  # the run's mesh on the CPU fallback (interop cannot import cli)
            code = emulate_for_run_dir(args.run_dir, argv)
            if code is not None:
                return code
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a closed stdout is caught below
        return code
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe of the command's own: a bug, with its traceback
        return _stdout_gone()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UserError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
