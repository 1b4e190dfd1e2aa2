"""SIGTERM/SIGINT as a flag the training loop turns into a save at a step all processes agree on.

``Preemption`` installs SIGTERM/SIGINT handlers that only set a flag, and
``Preemption.should_stop(step)``, called by the loop every step, returns True on all processes at
the same step once any process has been signalled: the processes agree with a tiny all-gather of
the flag (``jax.experimental.multihost_utils.process_allgather``) every ``check_every`` steps; in a
single process no collective is run. Why not JAX's ``reached_preemption_sync_point`` (which orbax's
``reached_preemption`` wraps): it returns False without ``jax.distributed`` (single-process runs
could never stop cleanly), it learns of the notice only through its own C++ SIGTERM handler (a
Python handler replaces it, and SIGINT is not covered), so it cannot serve all three cases, while
the all-gather works identically on one process, on CPU processes under ``jax.distributed`` (gloo)
and on Neuron. Its cost is one small collective and a host sync every ``check_every`` steps. The
same all-gather carries the loop's other reasons to stop together (a failed background save, a
lost run-dir claim: ``should_stop(step, save_failed=..., claim_lost=...)``), so every process
stops at the same step for the same reason.
After saving, the trainer exits with ``trn_accum.errors.EXIT_PREEMPTED`` (75, EX_TEMPFAIL:
"try again").
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)


class Preemption:
    """SIGTERM/SIGINT set a flag; ``should_stop(step)`` makes all processes agree to stop.

    Use::

        with Preemption() as pre:
            for step in range(start, end):
                state = train_step(state, batch)
                if pre.should_stop(step):
                    ckpt.save(step, state, force=True); ckpt.wait_until_finished()
                    sys.exit(EXIT_PREEMPTED)

    ``should_stop`` must be called by every process at every step (it is collective every
    `check_every` steps when there are several processes). It returns True at the first check
    after any process received a signal, on every process at the same step, and keeps returning
    True afterwards.
    """

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
        *,
        check_every: int = 1,
    ):
        if int(check_every) < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        self.signals = tuple(signals)
        self.check_every = int(check_every)
        self._event = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._agreed = False
        self.problems: set[str] = set()

    def _handler(self, signum, frame) -> None:
        self.received = signum
        self._event.set()

    def install(self) -> Preemption:
        """Install the handlers (main thread only; elsewhere a warning and no handler)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption handlers not installed: not on the main thread")
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before ``install``."""
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @property
    def requested(self) -> bool:
        """Whether this process has received a signal (local; not agreed)."""
        return self._event.is_set()

    def request(self) -> None:
        """Set the flag as a signal would (e.g. from a health check or a test)."""
        self._handler(None, None)

    def should_stop(self, step: int, **problems: bool) -> bool:
        """True when all processes should stop at `step` (same answer everywhere).

        `problems`: other local reasons to stop, by name (e.g. ``save_failed=True``); every
        process must pass the same names. They are agreed in the same all-gather as the
        signal flag: afterwards ``self.problems`` is the set of names true on any process.
        Returns True when any process was signalled (``self.preempted``; sticky) or has a
        problem.
        """
        self.problems = set()
        if self._agreed:
            return True
        names = sorted(problems)
        local = [int(self.requested)] + [int(bool(problems[n])) for n in names]
        if jax.process_count() == 1:
            agreed = local
        else:
            if int(step) % self.check_every:
                return False
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
            agreed = np.asarray(flags).reshape(-1, len(local)).max(axis=0).tolist()
        self.problems = {n for n, v in zip(names, agreed[1:], strict=True) if v}
        self._agreed = bool(agreed[0])
        return self._agreed or bool(self.problems)

    @property
    def preempted(self) -> bool:
        """Whether the processes agreed to stop for a signal."""
        return self._agreed


_ABANDONED: list[threading.Thread] = []  # native work left running by run_unless_signalled


def exit_now_if_abandoned(code: int) -> None:
    """End the process with `code` at once (`os._exit`, stdio flushed) while work that
    `run_unless_signalled` abandoned still runs: interpreter shutdown would unwind that thread
    inside XLA's C++ compile and abort ("FATAL: exception not rethrown"). Call it after every
    cleanup (claim released, files closed)."""
    if any(t.is_alive() for t in _ABANDONED):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def run_unless_signalled(fn, pre: Preemption, poll_s: float = 0.1) -> tuple[bool, Any]:
    """(True, fn()) when `fn` finishes first; (False, None) as soon as `pre` has been signalled.

    `fn` runs in a daemon thread, so a long native call (XLA's compile of the train step:
    minutes for the 3B step on trn2, longer than a scheduler's grace period) does not hold the
    signalled process: the main thread returns at once and the caller exits; the compile is
    abandoned with the process. An exception of `fn` is re-raised here."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, name="trn-accum-compile", daemon=True)
    thread.start()
    while not done.wait(poll_s):
        if pre.requested:
            _ABANDONED.append(thread)
            return False, None
    if "error" in box:
        raise box["error"]
    return True, box["value"]
