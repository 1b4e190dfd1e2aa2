"""Checkpoints (orbax) and preemption.

Layout of a checkpoint directory (orbax ``CheckpointManager``, one sub-directory per step)::

    DIR/<step>/state/...            the train state pytree (orbax StandardSave: OCDBT/zarr)
    DIR/<step>/meta/metadata        a small JSON (config dict, step, anything the caller adds)
    DIR/<step>/commit_success.txt   written by orbax just before it commits the step
    DIR/<step>.orbax-checkpoint-tmp a save in progress, or one that was killed

Commit marker. On a POSIX filesystem orbax writes a step into ``<step>.orbax-checkpoint-tmp``
and commits it by an atomic rename to ``<step>`` (after writing ``commit_success.txt`` inside);
on object stores (gs://) it writes into ``<step>`` and commits by writing
``commit_success.txt``. Either way orbax's step listing (``CheckpointManager.all_steps``) holds
committed steps only. ``Checkpointer`` additionally lists every step-named directory that orbax
does not count as committed and, when such a step is newer than the newest committed one, logs
a warning naming it (a save that was killed) and resumes from the newest committed step. Nothing
is ever deleted on restore; an uncommitted directory is replaced when that step is saved again.

A committed checkpoint that cannot be restored (corrupt files, or a state structure that does not
match) raises ``CheckpointError`` with one line naming its path; the trainer exits non-zero.

Restoring takes an abstract target: a pytree of ``jax.ShapeDtypeStruct`` with shardings, e.g.
``jax.eval_shape(init)`` plus the current mesh's shardings. Orbax reads each shard straight into
the target sharding, so a checkpoint saved on 8 devices restores on 4, or on another mesh or
process count.

Preemption. ``Preemption`` installs SIGTERM/SIGINT handlers that only set a flag, and
``Preemption.should_stop(step)``, called by the loop every step, returns True on all processes at
the same step once any process has been signalled: the processes agree with a tiny all-gather of
the flag (``jax.experimental.multihost_utils.process_allgather``) every ``check_every`` steps; in a
single process no collective is run. Why not JAX's ``reached_preemption_sync_point`` (which orbax's
``reached_preemption`` wraps): it returns False without ``jax.distributed`` (single-process runs
could never stop cleanly), it learns of the notice only through its own C++ SIGTERM handler (a
Python handler replaces it, and SIGINT is not covered), so it cannot serve all three cases, while
the all-gather works identically on one process, on CPU processes under ``jax.distributed`` (gloo)
and on Neuron. Its cost is one scalar collective and a host sync every ``check_every`` steps.
After saving, the trainer exits with ``trn_accum.errors.EXIT_PREEMPTED`` (75, EX_TEMPFAIL:
"try again").
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from trn_accum.errors import UserError

STATE_ITEM = "state"
META_ITEM = "meta"
_STEP_DIR = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp.*)?$")

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint problem the user must resolve; the message is one line naming the path."""


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    text = text[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def abstract_state(tree: Any) -> Any:
    """``ShapeDtypeStruct`` (with sharding where the leaf has one) for every array leaf of `tree`.

    Useful to restore into the layout of an existing state; for another mesh build the target
    from ``jax.eval_shape`` and the new shardings instead.
    """

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def make_writable_dir(directory: str) -> None:
    """Creates `directory` (and parents) and proves it writable with a probe file; OSError
    otherwise. Callers turn the OSError into their own one-line error."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


class Checkpointer:
    """Save every `save_every` steps (and on demand), keep the newest `keep`, resume the newest.

    Args:
      directory: where step directories live (created if missing). A path that cannot be
        created or written is a ``CheckpointError``.
      save_every: ``should_save(step)`` is ``step % save_every == 0``; None or 0 = only on demand.
      keep: how many committed checkpoints to keep (oldest deleted after a new commit); None = all.
      async_save: write in a background thread; ``save`` returns once the arrays are copied to
        host memory (so the caller may donate/delete them). ``wait_until_finished`` blocks.
    """

    def __init__(
        self,
        directory: str,
        *,
        save_every: int | None = None,
        keep: int | None = 3,
        async_save: bool = True,
    ):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_every = int(save_every or 0)
        if keep is not None and int(keep) < 1:
            raise CheckpointError(f"keep={keep} must be >= 1 (or None to keep all): raise it")
        if self.save_every < 0:
            raise CheckpointError(f"save_every={save_every} must be >= 0: use 0 to save on demand")
        try:
            make_writable_dir(self.directory)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint directory {self.directory} is not writable ({e.strerror}): choose "
                f"another run directory or fix its permissions"
            ) from None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if keep is None else int(keep),
            enable_async_checkpointing=bool(async_save),
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, META_ITEM)
        )

    # ------------------------------------------------------------------ listing

    def committed_steps(self) -> list[int]:
        """Committed steps found on disk when this object was built, plus the steps it saved
        since (a background save's step is listed from its start), minus those deleted by
        keep-last-K; ascending.

        Deliberately not re-read from disk: every process sees the same list, so all of them
        make the same save/skip decision (orbax saves are collective).
        """
        return sorted(int(s) for s in self._manager.all_steps())

    def uncommitted(self) -> list[tuple[int, str]]:
        """(step, path) of step-named directories that are not committed, ascending."""
        committed = set(self.committed_steps())
        out = []
        for name in os.listdir(self.directory):
            m = _STEP_DIR.match(name)
            path = os.path.join(self.directory, name)
            if m and os.path.isdir(path):
                step = int(m.group(1))
                if m.group(2) or step not in committed:
                    out.append((step, path))
        return sorted(out)

    def latest_step(self) -> int | None:
        """Newest committed step (None if none); warns about newer uncommitted saves."""
        steps = self.committed_steps()
        latest = steps[-1] if steps else None
        for step, path in self.uncommitted():
            if latest is None or step > latest:
                log.warning(
                    "skipping uncommitted checkpoint %s (no commit marker: a save that did not "
                    "finish); resuming from %s",
                    path,
                    "scratch" if latest is None else f"step {latest}",
                )
        return latest

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and int(step) % self.save_every == 0

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save `state` (a pytree of jax.Arrays / numpy / scalars) as `step` on every process.

        Saves when ``force`` or ``should_save(step)``; a step that is already committed is not
        saved again. `metadata` (JSON-serialisable) is stored beside the state with ``"step"``
        added. Returns whether a save was started. All processes must call this together.
        """
        if not (force or self.should_save(step)):
            return False
        step = int(step)
        if step in self.committed_steps():  # includes a save of this step still in progress
            return False
        meta = dict(metadata or {})
        meta.setdefault("step", step)
        ocp = self._ocp
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(meta)}
        )
        try:
            return bool(self._manager.save(step, args=args, force=True))
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoint {self.step_path(step)} ({_first_line(e)}): free space "
                f"or choose another run directory"
            ) from None

    def wait_until_finished(self) -> None:
        """Block until a background save has committed (raises if it failed)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restoring

    def restore(self, abstract_target: Any, step: int | None = None) -> tuple[Any, dict | None]:
        """Restore `step` (default: newest committed) into `abstract_target`.

        `abstract_target`: the state's pytree with ``jax.ShapeDtypeStruct(shape, dtype,
        sharding=...)`` leaves (shardings of the *current* mesh). Returns (state, metadata dict or
        None). Raises ``CheckpointError`` if there is no committed checkpoint or it cannot be
        read into the target. Nothing is deleted.
        """
        self._manager.wait_until_finished()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no committed checkpoint in {self.directory}: start without resuming or "
                    f"point at a directory with checkpoints"
                )
        step = int(step)
        path = self.step_path(step)
        if step not in self.committed_steps():
            raise CheckpointError(
                f"checkpoint {path} does not exist or is not committed: pick one of "
                f"{self.committed_steps()}"
            )
        ocp = self._ocp
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_target)})
        try:
            restored = self._manager.restore(step, args=args)
            state = restored[STATE_ITEM]
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({_first_line(e)}): move it aside to resume "
                f"from the previous one, or fix the config to match it"
            ) from None
        return state, self.read_metadata(step)

    def read_metadata(self, step: int | None = None) -> dict | None:
        """The JSON saved beside `step` (default: newest committed), or None if absent."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            return None
        path = os.path.join(self.step_path(step), META_ITEM)
        if not os.path.isdir(path):
            return None
        ocp = self._ocp
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
            )
        except Exception as e:
            raise CheckpointError(
                f"checkpoint metadata {path} cannot be read ({_first_line(e)}): move the "
                f"checkpoint aside to resume from the previous one"
            ) from None
        return restored[META_ITEM]


# ---------------------------------------------------------------------- preemption


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

    def should_stop(self, step: int) -> bool:
        """True when all processes should save at `step` and exit (same answer everywhere)."""
        if self._agreed:
            return True
        if jax.process_count() == 1:
            self._agreed = self.requested
            return self._agreed
        if int(step) % self.check_every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        self._agreed = bool(np.max(np.asarray(flags)) > 0)
        return self._agreed
