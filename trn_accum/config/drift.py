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

The record also holds the data's identity, ``data.fingerprint`` (`trn_accum.data.tokens.
fingerprint` of a prepared token directory; sampled digests of a Megatron .bin/.idx pair or of
a Hugging Face dataset's Arrow files; for a mixture, one line listing every component's name,
kind, weight and fingerprint, in order, beside the ``data.mixture`` tables themselves; None for
synthetic data, which the config fully determines): data re-prepared into the same path
between two runs, or a mixture with another weight or component, is a trajectory change like
any other (``--allow-config-change data`` or ``data.fingerprint`` / ``data.mixture`` accepts
it). A record from before the fingerprint existed is not checked for it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trn_accum.checkpoint.rundir import RunDirError, read_json
from trn_accum.errors import EXIT_SAVE_FAILED, UserError

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
        "trainer.gather",
        "trainer.memory_budget_gib",
        "trainer.stop_after_nonfinite",
        "trainer.max_skipped_fraction",
        "data.eval_batches",
        "model.layer_loop",
        "model.remat",
        "model.attention",
        "model.attention_block",
        "model.loss_chunk",
    }
)
FREE_SECTIONS = frozenset({"mesh", "checkpoint"})
# Keys of the run record that are not config keys; compared only when the old record has them.
RECORD_KEYS = frozenset({"data.fingerprint"})


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


def run_record(cfg: Mapping[str, Any], data_fingerprint: str | None) -> dict[str, Any]:
    """The run record: the config dict (`config_to_dict`) with ``data.fingerprint`` added."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in cfg.items()}
    out.setdefault("data", {})["fingerprint"] = data_fingerprint
    return out


def is_free(key: str) -> bool:
    return key in FREE_KEYS or key.split(".", 1)[0] in FREE_SECTIONS


def trajectory_changes(
    old: Mapping[str, Any], new: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} for every trajectory key whose value differs. A key missing from
    `old` (a record from before the key existed) counts as its default from `defaults`."""
    recorded = flatten(old)
    before = {**flatten(defaults), **recorded}
    after = flatten(new)
    return {
        k: (before.get(k), after[k])
        for k in sorted(after)
        if not is_free(k) and (k not in RECORD_KEYS or k in recorded) and before.get(k) != after[k]
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


def check_same_config(record: Mapping[str, Any]) -> None:
    """ConfigDriftError, the same line on every process, when any process's config (a
    `config_to_dict` record) differs from process 0's; nothing with one process. Every process
    must call it (two all-gathers over the coordinator's processes: the lengths, then the
    JSON bytes), so each can name every differing key and value."""
    import jax
    import numpy as np

    n_proc = jax.process_count()
    if n_proc == 1:
        return
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(record, sort_keys=True, default=str).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int32)))
    lengths = lengths.reshape(n_proc)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(n_proc, -1)
    flat = [flatten(json.loads(bytes(gathered[i, : lengths[i]]))) for i in range(n_proc)]
    differ = []
    for i in range(1, n_proc):
        a, b = flat[0], flat[i]
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if keys:
            shown = ", ".join(f"{k} {_show(a.get(k))} vs {_show(b.get(k))}" for k in keys)
            differ.append(f"process {i} differs from process 0 in {shown}")
    if differ:
        raise ConfigDriftError(
            f"the {n_proc} processes of this job do not run one config: {'; '.join(differ)}: "
            f"give every process the same --config file and --set overrides"
        )
