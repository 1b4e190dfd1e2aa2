"""Reading a checkpoint directory that a trainer may be writing: `eval` and `export-hf`.

    step, value = read_newest("runs/x/checkpoints", lambda step_dir: ...)

A `Checkpointer` owns its directory: it creates it, removes the leftovers of killed saves, writes
and deletes steps. A reader does none of that. It lists the committed steps by orbax's own rule
(`committed_steps`: the step directories that orbax's standard step-name format finds
finalized, which is what `CheckpointManager.all_steps`, and so `Checkpointer`, lists) and reads
one of them with orbax's checkpointers, which only open files. It creates, renames and deletes
nothing, so it needs only read permission, and a trainer's save in progress
(``<step>.orbax-checkpoint-tmp``) is never touched.

A trainer's keep-last-K may delete the step being read (it renames it away, then removes it).
`read_newest` then reads the newest committed step again, a few times; a step that stays
committed and still cannot be read is a `CheckpointError` naming it (damaged files).

Orbax runs each restore on an event loop of its own, which it closes without waiting for the
reads still pending when one of them fails: those were later closed by the garbage collector,
each printing an `Exception ignored in: <coroutine ...>` traceback. `finishing_loops` has the
loops a restore makes cancel and finish their pending reads before they close, as
`asyncio.run` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import orbax.checkpoint as ocp

from trn_accum.checkpoint.checkpointer import META_ITEM, STATE_ITEM, CheckpointError
from trn_accum.checkpoint.save_errors import first_line
from trn_accum.errors import UserError

T = TypeVar("T")
TRIES = 3  # reads of the newest step when keep-last-K deletes the one being read


def committed_steps(directory: str) -> list[int]:
    """The committed steps in `directory`, ascending, listed as `CheckpointManager` lists them
    (orbax's standard step-name format: a step-named directory that is finalized). Reads the
    directory only; [] when it does not exist."""
    if not os.path.isdir(directory):
        return []
    found = ocp.step.standard_name_format().find_all(directory)
    return sorted(int(m.step) for m in found)


class _FinishingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed while idle, first cancels its pending tasks and runs
    them to their end (what `asyncio.run` does before closing)."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _FinishingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _FinishingLoop()


@contextlib.contextmanager
def finishing_loops() -> Iterator[None]:
    """Within: the event loops orbax creates finish their pending tasks before closing."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_FinishingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


def read_metadata(step_dir: str) -> dict | None:
    """The JSON that `Checkpointer.save` stored beside the state of `step_dir`, or None."""
    path = os.path.join(step_dir, META_ITEM)
    if not os.path.isdir(path):
        return None
    with finishing_loops(), ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
        return reader.restore(path)


def read_state(step_dir: str, target: dict) -> dict:
    """The subtrees of the state in `step_dir` that `target` names (ShapeDtypeStructs with
    shardings; e.g. {"params": ...}), each shard read into place: an orbax partial restore,
    so nothing else (the optimizer state) is read."""
    args = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )
    with finishing_loops(), ocp.PyTreeCheckpointer() as reader:
        return reader.restore(os.path.join(step_dir, STATE_ITEM), args=args)


def read_newest(directory: str, read: Callable[[str], T], fix: str) -> tuple[int, T]:
    """(the newest committed step of `directory`, `read(its step directory)`). A step deleted
    while it is read (keep-last-K of a live trainer) is read again from the newest; one that
    stays committed and cannot be read is a CheckpointError naming it, `fix` its advice. A
    UserError of `read` (a missing config record) passes through."""
    directory = os.path.abspath(directory)  # orbax reads absolute paths only
    for _ in range(TRIES):
        steps = committed_steps(directory)
        if not steps:
            raise CheckpointError(f"{directory} holds no committed checkpoint: train first")
        step_dir = os.path.join(directory, str(steps[-1]))
        try:
            return steps[-1], read(step_dir)
        except UserError:  # the reader's own one-line errors (a config record that is missing)
            raise
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data
            if steps[-1] in committed_steps(directory):
                raise CheckpointError(
                    f"checkpoint {step_dir} cannot be read ({first_line(e)}): {fix}"
                ) from None
    raise CheckpointError(
        f"the newest checkpoint of {directory} was deleted while it was read, {TRIES} times: "
        f"keep more checkpoints (checkpoint.keep) or read when the trainer is not rotating"
    )
