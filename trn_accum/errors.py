"""Errors a user can cause, and the process exit codes: the one home of both.

Every problem a user can fix (a config value, data, a checkpoint, the launch environment, a
mesh that does not fit the devices, a command-line value) raises a `UserError`: one line that
names the value, the rule and a fix, and carries the exit code the CLI returns for it. The CLI
prints `trn-accum: error: <message>` for any `UserError` and exits with its code; anything else
is a bug and keeps its traceback (exit 1).

`UserError` is a `ValueError`, so library callers that catch ValueError keep working. The
accumulation core (`trn_accum.core`) raises plain `ValueError`s: it is a JAX library and knows
nothing of exit codes.
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_OK = 0
#: A check failed (dry-run blockers, a failing `neuron-check` row); also what Python exits
#: with on an uncaught exception (a bug: the traceback is kept).
EXIT_FAILED = 1
#: A user error: bad config, data, checkpoint, launch environment or arguments.
EXIT_USAGE = 2
#: EX_IOERR: a checkpoint could not be written (disk full, quota, permissions, a vanished
#: mount). The previous committed checkpoint is intact; fix the storage and run again.
EXIT_SAVE_FAILED = 74
#: EX_TEMPFAIL: preempted (SIGTERM/SIGINT) after saving a checkpoint; run the same command
#: again to resume.
EXIT_PREEMPTED = 75
#: Interrupted before anything could be saved (a second Ctrl-C).
EXIT_INTERRUPTED = 130


class UserError(ValueError):
    """A problem the user can fix: `str(e)` is one line (value, rule, fix); `e.exit_code` is
    what the CLI exits with (default `EXIT_USAGE`)."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = int(exit_code)


def one_line(message: object) -> str:
    """`message` with all whitespace runs (newlines included) collapsed to single spaces."""
    return " ".join(str(message).split())


def listed(items: Sequence[str], most: int = 3, sep: str = "; ") -> str:
    """The first `most` of `items` joined by `sep`, and how many more there are: the list a
    one-line error names ("a; b; c and 4 more")."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return sep.join(items[:most]) + more
