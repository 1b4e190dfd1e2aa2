"""What a failed checkpoint save or restore says, once: the failure's OS-level cause in one line,
and orbax's own noise dropped (its ERROR records with tracebacks from save threads, and the
late 'Event loop is closed' / unretrieved-future errors of a failed save's pending writes)."""

from __future__ import annotations

import logging
import os
import re
import sys


class DropOrbaxErrors(logging.Filter):
    """Drops orbax's ERROR records (logged with tracebacks from its save threads): the
    Checkpointer raises one CheckpointError for the same failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in (record.pathname or ""))


ORBAX_FILTER = DropOrbaxErrors()


def is_closed_loop_error(exc: BaseException, tb) -> bool:
    """RuntimeError('Event loop is closed') raised in asyncio's `call_soon_threadsafe`: the
    I/O threads of a failed background save finishing after orbax closed its event loop."""
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_name == "_check_closed"


class DropUnretrievedFutures(logging.Filter):
    """asyncio's 'Future exception was never retrieved' records: the other writes of a save
    that already failed, which nobody awaits any more."""

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.msg).split("\n", 1)[0]  # "<Future class> exception was never ..."
        return not first.endswith("exception was never retrieved")


def drop_closed_loop_errors() -> None:
    """For the process's lifetime (installed once), drop what the pending writes of a failed
    save print after orbax has given up on them: late
    'Event loop is closed' errors (through sys.unraisablehook, from the I/O library's threads)
    and asyncio's unretrieved-future errors. The CheckpointError has said what happened;
    anything else prints as before."""
    previous = sys.unraisablehook
    if getattr(previous, "_trn_accum_drops_closed_loop", False):
        return
    logging.getLogger("asyncio").addFilter(DropUnretrievedFutures())

    def hook(unraisable):
        if not is_closed_loop_error(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    hook._trn_accum_drops_closed_loop = True
    sys.unraisablehook = hook


def failure_cause(e: BaseException) -> str:
    """The OS-level cause of a failed write ("No space left on device"), else its first line."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if code is None:
        m = re.search(r"os_error_code='?(\d+)", str(e))
        code = int(m.group(1)) if m else None
    return os.strerror(code) if code else first_line(e)


def first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    text = text[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
