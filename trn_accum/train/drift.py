"""The run's trajectory record: what determines its numbers, and the changes allowed on resume.

``RUN_DIR/config.json`` and every checkpoint's metadata record the full config. On resume the
keys that determine the trajectory (everything but ``FREE_KEYS`` / ``FREE_SECTIONS``: the model,
the data, the seeds, the global batch, the optimizer and its schedule) are compared with the
config the restored checkpoint was written with (its metadata; ``config.json`` when the metadata
has none, e.g. older checkpoints). A change is a one-line ``ConfigDriftError`` listing each key
(old -> new) unless the user allows it (``--allow-config-change KEY|SECTION ...``): then it is
appended to ``RUN_DIR/config_changes.jsonl`` (step, time, old and new values) and becomes the
record. Free: what does not change the numbers (length, logging/eval/checkpoint cadence, and
how the same math is laid out: accumulation is exact, so ``accum_steps``, ``loop``, ``reduce``,
the mesh and the device or node count are free too). A key missing from an old record (added
to the config later) is compared as its default.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trn_accum.errors import EXIT_SAVE_FAILED, UserError
from trn_accum.train.rundir import RunDirError, read_json

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"

# Config keys that do not change the numbers: cadence, length, and how the same math is laid
# out (accumulation is exact; the mesh, device and node count only place the same arrays;
# remat, the layer loop, the attention kernel and the loss chunking compute the same function).
FREE_KEYS = frozenset(
    {
        "trainer.steps",
        "trainer.log_every",
        "trainer.eval_every",
        "trainer.accum_steps",
        "trainer.loop",
        "trainer.reduce",
        "trainer.memory_budget_gib",
        "trainer.stop_after_nonfinite",
        "data.eval_batches",
        "model.layer_loop",
        "model.remat",
        "model.attention",
        "model.attention_block",
        "model.loss_chunk",
    }
)
FREE_SECTIONS = frozenset({"mesh", "checkpoint"})


class ConfigDriftError(UserError):
    """A resume would change what determines the trajectory: one line, each key old -> new."""


def flatten(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """{"section.key": value} of a nested config dict (non-dict sections are skipped)."""
    return {
        f"{section}.{key}": value
        for section, keys in cfg.items()
        if isinstance(keys, Mapping)
        for key, value in keys.items()
    }


def is_free(key: str) -> bool:
    return key in FREE_KEYS or key.split(".", 1)[0] in FREE_SECTIONS


def trajectory_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} for every trajectory key whose value differs. A key missing from
    `old` (a record from before the key existed) counts as its default from `defaults`."""
    before = {**flatten(defaults), **flatten(old)}
    after = flatten(new)
    return {
        k: (before.get(k), after[k])
        for k in sorted(after)
        if not is_free(k) and before.get(k) != after[k]
    }


def check_allowed_keys(keys: Iterable[str], defaults: Mapping[str, Any]) -> set[str]:
    """The keys of `--allow-config-change`: each a `section.key` of the config or a section
    name (all its keys). ConfigDriftError naming an unknown one."""
    known = flatten(defaults)
    out: set[str] = set()
    for key in keys:
        if key in known:
            out.add(key)
        elif key in defaults:
            out.update(k for k in known if k.startswith(key + "."))
        else:
            raise ConfigDriftError(
                f"--allow-config-change {key}: not a config key; give section.key (e.g. "
                f"data.seed) or a section ({', '.join(defaults)})"
            )
    return out


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def check_drift(
    changes: Mapping[str, tuple[Any, Any]],
    allowed: set[str],
    *,
    run_dir: str,
    step: int,
    record: str,
) -> None:
    """ConfigDriftError listing the changes not in `allowed`."""
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if not refused:
        return
    listed = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
    raise ConfigDriftError(
        f"resuming run dir {run_dir} at step {step} would change its trajectory: {listed} "
        f"(recorded in {record}): run with the recorded values, or pass --allow-config-change "
        f"{' '.join(refused)} to change them from step {step} on (logged in "
        f"{os.path.join(run_dir, CHANGES_FILE)}), or use another --run-dir"
    )


def log_changes(run_dir: str, step: int, changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Append one record of allowed changes to RUN_DIR/config_changes.jsonl."""
    if not changes:
        return
    row = {"step": int(step), "time": round(time.time(), 3)}
    row["changes"] = {k: {"old": a, "new": b} for k, (a, b) in changes.items()}
    path = os.path.join(run_dir, CHANGES_FILE)
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise RunDirError(
            f"cannot write {path} ({e.strerror}): free space or fix the run dir's storage",
            exit_code=EXIT_SAVE_FAILED,
        ) from None


def recorded_config(run_dir: str, checkpoint_meta: Any) -> tuple[dict | None, str]:
    """(the config the resumed state was trained with, where it was read). The checkpoint's
    metadata is the record; RUN_DIR/config.json stands in when the metadata has none. (None,
    why) when neither is readable."""
    if isinstance(checkpoint_meta, dict) and isinstance(checkpoint_meta.get("config"), dict):
        return checkpoint_meta[
            "config"
        ], f"checkpoint {checkpoint_meta.get('step', '?')}'s metadata"
    path = os.path.join(run_dir, CONFIG_FILE)
    value, problem = read_json(path)
    if (
        problem is None
        and isinstance(value, dict)
        and all(isinstance(v, dict) for v in value.values())
    ):
        return value, path
    return None, f"{path} is {problem or 'not a table of sections'}"
