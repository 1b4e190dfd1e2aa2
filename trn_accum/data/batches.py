"""What both datasets share: the checks of their arguments (sequence length, batch size,
split, row indices) and the batch dict built from token windows ([n, S+1] -> [n, S] inputs,
next-token targets and their mask)."""

from __future__ import annotations

import numpy as np

from trn_accum.data.tokens import DataError

SPLITS = {"train": 0, "eval": 1}


def check_common(seq_len: int, batch_size: int, max_seq_len: int | None) -> None:
    if int(seq_len) < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1: set a positive sequence length")
    if max_seq_len is not None and int(seq_len) > int(max_seq_len):
        raise DataError(
            f"seq_len={seq_len} is longer than the model's max_seq_len={max_seq_len}: "
            f"lower the sequence length or raise the model's maximum"
        )
    if int(batch_size) < 1:
        raise DataError(f"batch_size={batch_size} must be >= 1: set a positive global batch")


def check_split(split: str) -> int:
    if split not in SPLITS:
        raise DataError(f"split={split!r} is not one of {sorted(SPLITS)}: use 'train' or 'eval'")
    return SPLITS[split]


def check_rows(row_indices: np.ndarray, batch_size: int) -> np.ndarray:
    rows = np.asarray(row_indices, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= batch_size):
        raise DataError(
            f"row indices {rows.min()}..{rows.max()} are outside the global batch "
            f"[0, {batch_size}): pass rows of a batch of {batch_size}"
        )
    return rows


def assemble(windows: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """[n, S+1] token windows with `lengths` real tokens each -> a batch dict of [n, S]."""
    seq_len = windows.shape[1] - 1
    positions = np.arange(seq_len)[None, :]
    mask = (positions + 1 < lengths[:, None]).astype(np.float32)
    return {
        "input_ids": np.ascontiguousarray(windows[:, :-1], dtype=np.int32),
        "target_labels": np.ascontiguousarray(windows[:, 1:], dtype=np.int32),
        "target_mask": mask,
    }
