"""Checkpoints (orbax): save, keep, resume the newest committed step, report save failures.

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
a warning naming it (a save that was killed) and resumes from the newest committed step. At
start, process 0 removes the ``*.orbax-checkpoint-tmp*`` leftovers of killed saves and deletions
and logs the bytes freed (`trn_accum.checkpoint.leftovers`); a committed step is never touched.

Keep-last-K is done here, after a commit: only steps older than the newest `keep` committed ones
are deleted (renamed to ``<step>.orbax-checkpoint-tmp-deleted`` first); one that cannot be is a
warning naming it and its path, and the run goes on. A failed save removes only uncommitted dirs.

A committed checkpoint that cannot be restored (corrupt files, or a state structure that does not
match) raises ``CheckpointError`` with one line naming its path; the trainer exits non-zero. The
shapes are compared with the checkpoint's array metadata before any array is read, so a config
whose shapes differ is named leaf by leaf (and no half-finished read is left behind).

Save failures (disk full, quota, permissions, a vanished mount) raise ``CheckpointError`` with
exit code ``trn_accum.errors.EXIT_SAVE_FAILED``, naming the step's path and the cause, whether
they happen when the save starts or in the background: ``background_failure()`` (non-blocking,
called by the trainer at every step boundary) reports a background save that has failed, and
removes its partial step directory, so the newest committed checkpoint is the one a resume
finds. Orbax's own error logs of a failed background save (a traceback per thread) are dropped
while a ``Checkpointer`` is open: the ``CheckpointError`` says it once.

Restoring takes an abstract target: a pytree of ``jax.ShapeDtypeStruct`` with shardings, e.g.
``jax.eval_shape(init)`` plus the current mesh's shardings. Orbax reads each shard straight into
the target sharding, so a checkpoint saved on 8 devices restores on 4, or on another mesh or
process count.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax

from trn_accum.checkpoint.leftovers import (
    DELETED_SUFFIX,
    STEP_DIR,
    make_writable_dir,
    remove_leftovers,
)
from trn_accum.checkpoint.save_errors import (
    ORBAX_FILTER,
    drop_closed_loop_errors,
    failure_cause,
    first_line,
)
from trn_accum.checkpoint.shapes import abstract_state, leaf_path, shape_mismatches
from trn_accum.errors import EXIT_SAVE_FAILED, UserError, listed

__all__ = ["CheckpointError", "Checkpointer", "abstract_state", "make_writable_dir"]

STATE_ITEM = "state"
META_ITEM = "meta"

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint problem the user must resolve; the message is one line naming the path."""


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
        if jax.process_index() == 0:  # killed saves' and deletions' full-size copies
            remove_leftovers(self.directory)
        self.keep = None if keep is None else int(keep)
        self._async = bool(async_save)
        self._rotated: set[int] = set()  # steps keep-last-K has deleted (or tried to)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is ours (_rotate): after a commit, never the newest
            enable_async_checkpointing=bool(async_save),
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                META_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
        self._warned: set[str] = set()
        self._pending: int | None = None  # the step of the newest save started
        logging.getLogger("absl").addFilter(ORBAX_FILTER)
        drop_closed_loop_errors()

    # ------------------------------------------------------------------ listing

    def committed_steps(self) -> list[int]:
        """Committed steps found on disk when this object was built, plus the steps it saved
        since (a background save's step is listed from its start), minus those deleted by
        keep-last-K; ascending.

        Deliberately not re-read from disk: every process sees the same list, so all of them
        make the same save/skip decision (orbax saves are collective).
        """
        return sorted(int(s) for s in self._manager.all_steps() if int(s) not in self._rotated)

    def uncommitted(self) -> list[tuple[int, str]]:
        """(step, path) of step-named directories that are not committed, ascending."""
        committed = set(self.committed_steps())
        out = []
        for name in os.listdir(self.directory):
            m = STEP_DIR.match(name)
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
            if (latest is None or step > latest) and path not in self._warned:
                self._warned.add(path)
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
        previous = self._pending
        try:
            started = bool(self._manager.save(step, args=args, force=True))
        except Exception as e:  # orbax/tensorstore raise many types for a failed write
            # orbax first waits for the previous background save: its failure surfaces here.
            prev = None if previous is None else self.step_path(previous)
            ours = prev is None or not any(prev + c in str(e) for c in "./")
            raise self._failure(step if ours else previous, e) from None
        if started:
            self._pending = step
        self._rotate(pending=step if started and self._async else None)  # previous: committed
        return started

    def _rotate(self, pending: int | None = None) -> None:
        """Keep-last-K once a step has committed: deletes the committed steps older than the
        newest `keep` (`pending`, a save still running, neither counts nor goes). A failed
        deletion is one warning naming the step and its path; the run goes on."""
        if self.keep is None:
            return
        steps = [s for s in self.committed_steps() if s != pending]
        for step in steps[: -self.keep]:
            self._rotated.add(step)  # on every process: all of them list the same steps
            if jax.process_index() != 0:
                continue
            path = self.step_path(step)
            try:  # renamed first: uncommitted from then on, even if the rmtree stops half-way
                os.rename(path, doomed := path + DELETED_SUFFIX)
                shutil.rmtree(doomed)
            except OSError as e:
                log.warning(
                    f"old checkpoint step {step} at {e.filename or path} could not be deleted "
                    f"({failure_cause(e)}): it stays on disk (keep={self.keep}); training goes on"
                )

    def _failure(self, step: int | None, e: BaseException) -> CheckpointError:
        """The one-line error of a failed save of `step`; its partial directories removed."""
        if step is not None:
            self._remove_partial(step)
        path = self.directory if step is None else self.step_path(step)
        committed = [s for s in self._committed_on_disk() if s != step]
        kept = (
            f"the previous checkpoint {self.step_path(committed[-1])} is intact"
            if committed
            else "there is no earlier checkpoint"
        )
        return CheckpointError(
            f"checkpoint {path} could not be written ({failure_cause(e)}); {kept}: free space or "
            f"fix the storage (quota, permissions, mount), then run the same command again to "
            f"resume",
            exit_code=EXIT_SAVE_FAILED,
        )

    def _committed_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(self.step_path(n)))

    def _remove_partial(self, step: int) -> None:
        """Removes the uncommitted directories of `step` (process 0; the others share them)."""
        if jax.process_index() != 0:
            return
        for s, path in self.uncommitted():
            marker = os.path.join(path, "commit_success.txt")
            if s == step and not (path == self.step_path(s) and os.path.exists(marker)):
                shutil.rmtree(path, ignore_errors=True)
                self._warned.add(path)

    def background_failure(self) -> CheckpointError | None:
        """Non-blocking: the CheckpointError of a background save that has failed (once), else
        None (no save, one still running, or all committed)."""
        if self._pending is None or self._manager.is_saving_in_progress():
            return None
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()  # finished: returns at once, or raises
        except Exception as e:
            return self._failure(step, e)
        self._rotate()
        return None

    def wait_until_finished(self) -> None:
        """Block until a background save has committed; CheckpointError (EXIT_SAVE_FAILED)
        if it failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            step, self._pending = self._pending, None
            raise self._failure(step, e) from None
        self._pending = None
        self._rotate()

    def close(self) -> None:
        try:
            try:
                self._manager.wait_until_finished()
            except Exception:
                pass  # a failed save was reported (or is being) by the caller
            self._manager.close()
        finally:
            logging.getLogger("absl").removeFilter(ORBAX_FILTER)

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
        self._check_shapes(step, abstract_target)
        ocp = self._ocp
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_target)})
        try:
            restored = self._manager.restore(step, args=args)
            state = restored[STATE_ITEM]
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({first_line(e)}): its files are damaged; "
                f"move it aside to resume from the previous one"
            ) from None
        return state, self.read_metadata(step)

    def _check_shapes(self, step: int, abstract_target: Any) -> None:
        """CheckpointError naming the leaves whose stored shape differs from the target's (or
        that are missing), before any array is read. Unreadable metadata: left to restore."""
        try:
            stored = self._manager.item_metadata(step)[STATE_ITEM]
            have = {leaf_path(p): tuple(m.shape) for p, m in jax.tree.leaves_with_path(stored)}
        except Exception:
            return
        bad = shape_mismatches(have, abstract_target) if have else []
        if bad:
            raise CheckpointError(
                f"checkpoint {self.step_path(step)} holds a state of other shapes than this "
                f"config makes: {listed(bad)}: it was written with another model "
                f"config; resume with the config it was saved with, or start a new run dir"
            )

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
                f"checkpoint metadata {path} cannot be read ({first_line(e)}): move the "
                f"checkpoint aside to resume from the previous one"
            ) from None
        return restored[META_ITEM]
