"""Datasets and process-local global batches.

A batch is a dict of numpy arrays (host) or jax.Arrays (device), shapes [B, S]::

    input_ids      int32    tokens fed to the model
    target_labels  int32    the next token of each position
    target_mask    float32  1 for a real target, 0 on padding

Two datasets share one interface, ``rows(step, row_indices, split) -> batch``: the given rows
of the global batch of that step, which depend only on ``(seed, s)`` (and the global batch
size), so a resumed run sees the batches it would have seen and every process builds its own.

- ``SyntheticDataset``: a fixed random first-order Markov chain (seeded), some rows cut short
  and padded (minibatches carry unequal numbers of real tokens). No files.
- ``TokenDataset``: a flat token file (uint16/uint32, read with ``os.pread``), a
  document-offsets file and a JSON sidecar (read as possibly garbage: every field is checked;
  `trn_accum.train.tokens`), written by ``trn_accum.train.prepare``; every id of a host batch is
  checked against the model's vocabulary. Documents are cut into windows of ``seq_len + 1`` tokens
  (neighbours share one token); a short document or last window is padded (``target_mask``
  0). No packing across documents. A held-out set of documents forms the eval split.

``global_batch`` assembles the global [B, S] arrays with
``jax.make_array_from_process_local_data`` from the rows each process's devices hold.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from trn_accum.train.tokens import (  # noqa: F401  (DataError, read_meta: this module's API too)
    DataError,
    TokenFile,
    check_ids,
    check_vocab,
    fingerprint,
    read_meta,
)

_SPLITS = {"train": 0, "eval": 1}
BATCH_KEYS = ("input_ids", "target_labels", "target_mask")
DATA_KINDS = ("synthetic", "tokens")


class Dataset(Protocol):
    """What ``global_batch`` needs from a dataset."""

    seq_len: int
    batch_size: int
    vocab_size: int

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]: ...


# --------------------------------------------------------------------------- helpers


def _check_common(seq_len: int, batch_size: int, max_seq_len: int | None) -> None:
    if int(seq_len) < 1:
        raise DataError(f"seq_len={seq_len} must be >= 1: set a positive sequence length")
    if max_seq_len is not None and int(seq_len) > int(max_seq_len):
        raise DataError(
            f"seq_len={seq_len} is longer than the model's max_seq_len={max_seq_len}: "
            f"lower the sequence length or raise the model's maximum"
        )
    if int(batch_size) < 1:
        raise DataError(f"batch_size={batch_size} must be >= 1: set a positive global batch")


def _check_split(split: str) -> int:
    if split not in _SPLITS:
        raise DataError(f"split={split!r} is not one of {sorted(_SPLITS)}: use 'train' or 'eval'")
    return _SPLITS[split]


def _check_rows(row_indices: np.ndarray, batch_size: int) -> np.ndarray:
    rows = np.asarray(row_indices, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= batch_size):
        raise DataError(
            f"row indices {rows.min()}..{rows.max()} are outside the global batch "
            f"[0, {batch_size}): pass rows of a batch of {batch_size}"
        )
    return rows


def _assemble(windows: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
    """[n, S+1] token windows with `lengths` real tokens each -> a batch dict of [n, S]."""
    seq_len = windows.shape[1] - 1
    positions = np.arange(seq_len)[None, :]
    mask = (positions + 1 < lengths[:, None]).astype(np.float32)
    return {
        "input_ids": np.ascontiguousarray(windows[:, :-1], dtype=np.int32),
        "target_labels": np.ascontiguousarray(windows[:, 1:], dtype=np.int32),
        "target_mask": mask,
    }


# --------------------------------------------------------------------------- synthetic


class SyntheticDataset:
    """Deterministic sequences from a fixed random Markov chain; no files.

    Token 0 is padding; the chain runs over ids ``1 .. num_states`` (``num_states`` defaults to
    ``min(vocab_size - 1, 64)``). Each state has ``len(branch_probs)`` successors drawn once from
    ``seed``, chosen with probabilities ``branch_probs`` (entropy about 1.2 nats for the default,
    against ``ln(vocab_size)`` for a fresh model). A fraction ``pad_fraction`` of the rows is cut
    to a random length in ``[min_len_fraction * (S+1), S]`` and padded.

    Row ``r`` of step ``s`` comes from its own generator seeded with ``(seed, split, s, r)``,
    so any subset of rows can be built alone; eval rows use a different stream than train rows.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        num_states: int | None = None,
        branch_probs: Sequence[float] = (0.55, 0.25, 0.12, 0.08),
        pad_fraction: float = 0.25,
        min_len_fraction: float = 0.25,
        max_seq_len: int | None = None,
    ):
        _check_common(seq_len, batch_size, max_seq_len)
        if int(vocab_size) < 2:
            raise DataError(
                f"vocab_size={vocab_size} is too small for synthetic data (needs >= 2: "
                f"padding + one token): raise the model's vocab_size"
            )
        if not 0.0 <= pad_fraction <= 1.0:
            raise DataError(f"pad_fraction={pad_fraction} must be in [0, 1]")
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_states = int(num_states or min(self.vocab_size - 1, 64))
        if not 1 <= self.num_states <= self.vocab_size - 1:
            raise DataError(
                f"num_states={self.num_states} must be in [1, vocab_size - 1 = "
                f"{self.vocab_size - 1}]: lower num_states"
            )
        probs = np.asarray(branch_probs, dtype=np.float64)
        self._cum = np.cumsum(probs / probs.sum())
        self._cum[-1] = 1.0
        table_rng = np.random.default_rng([self.seed, 0x5EED])
        self._successors = table_rng.integers(0, self.num_states, (self.num_states, probs.size))
        self.pad_fraction = float(pad_fraction)
        self.min_len_fraction = float(min_len_fraction)
        self.pad_id = 0

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]:
        """The given rows (indices into the global batch of `step`) as int32/float32 [n, S]."""
        split_id = _check_split(split)
        rows = _check_rows(row_indices, self.batch_size)
        n, s1 = rows.size, self.seq_len + 1
        uniforms = np.empty((n, s1), np.float64)
        lengths = np.full(n, s1, np.int64)
        lo = max(2, min(s1, int(self.min_len_fraction * s1)))
        for j, r in enumerate(rows):
            rng = np.random.default_rng([self.seed, split_id, int(step), int(r)])
            uniforms[j] = rng.random(s1)
            if rng.random() < self.pad_fraction:
                lengths[j] = rng.integers(lo, max(lo, s1 - 1) + 1)
        windows = np.zeros((n, s1), np.int64)
        state = np.minimum((uniforms[:, 0] * self.num_states).astype(np.int64), self.num_states - 1)
        windows[:, 0] = state
        for t in range(1, s1):
            branch = np.searchsorted(self._cum, uniforms[:, t], side="right")
            state = self._successors[state, np.minimum(branch, self._cum.size - 1)]
            windows[:, t] = state
        windows += 1  # id 0 is padding
        windows[np.arange(s1)[None, :] >= lengths[:, None]] = self.pad_id
        return _assemble(windows, lengths)


def _windows(offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut documents into windows of seq_len+1 tokens sharing one token between neighbours.

    Returns (start, length, document) per window, int64. A document of n tokens has n-1
    targets and ceil((n-1)/seq_len) windows; documents of fewer than 2 tokens have none.
    """
    starts_doc = offsets[:-1].astype(np.int64)
    doc_len = np.diff(offsets).astype(np.int64)
    n_win = np.where(doc_len >= 2, -(-(doc_len - 1) // seq_len), 0)
    total = int(n_win.sum())
    doc = np.repeat(np.arange(doc_len.size, dtype=np.int64), n_win)
    first = np.cumsum(n_win) - n_win
    k = np.arange(total, dtype=np.int64) - np.repeat(first, n_win)
    start = starts_doc[doc] + k * seq_len
    length = np.minimum(seq_len + 1, starts_doc[doc] + doc_len[doc] - start)
    return start, length, doc


class TokenDataset:
    """Windows of a prepared token file (`trn_accum.train.tokens`), read with ``os.pread``;
    every id of a host batch is checked against the model's vocabulary (`check_ids`).

    Train rows: sample ``i = step * batch_size + row`` of an endless stream that visits every
    train window once per epoch, in an order permuted with ``(seed, epoch)``. Eval rows: the
    held-out windows in order, ``(step * batch_size + row) mod n_eval``. Held out: a seeded
    choice of ``max(1, round(eval_fraction * documents))`` documents when there are at least two,
    else the last windows of the only document, else (a single window) the train window itself.
    """

    def __init__(
        self,
        path: str,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        eval_fraction: float = 0.01,
        model_vocab: int | None = None,
        max_seq_len: int | None = None,
    ):
        _check_common(seq_len, batch_size, max_seq_len)
        meta = read_meta(path)
        if model_vocab is not None:
            check_vocab(meta, model_vocab)
        self.meta = meta
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.vocab_size = int(meta["vocab_size"])
        self.pad_id = int(meta.get("pad_id", meta["eos_id"]))
        n_tok, n_doc = int(meta["num_tokens"]), int(meta["num_documents"])
        self.model_vocab = int(model_vocab) if model_vocab is not None else self.vocab_size
        self.tokens = TokenFile(meta["tokens_path"], meta["dtype"], n_tok)
        try:
            offsets = np.load(meta["offsets_path"], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(
                f"offsets file {meta['offsets_path']} is not a readable .npy array "
                f"({type(e).__name__}): re-run `trn-accum prepare-data`"
            ) from None
        offsets = np.asarray(offsets, dtype=np.int64)
        if (
            offsets.ndim != 1
            or offsets.size != n_doc + 1
            or offsets[0] != 0
            or offsets[-1] != n_tok
            or np.any(np.diff(offsets) < 0)
        ):
            raise DataError(
                f"offsets file {meta['offsets_path']} does not describe {n_doc} documents of "
                f"{n_tok} tokens (needs {n_doc + 1} non-decreasing offsets from 0 to {n_tok}): "
                f"re-run `trn-accum prepare-data`"
            )
        start, length, doc = _windows(offsets, self.seq_len)
        if start.size == 0:
            raise DataError(
                f"token data {meta['tokens_path']} has no document of 2 or more tokens, so no "
                f"training window: prepare it from non-empty text files"
            )
        eval_mask = self._held_out(doc, n_doc, float(eval_fraction))
        self._train = (start[~eval_mask], length[~eval_mask])
        self._eval = (start[eval_mask], length[eval_mask]) if eval_mask.any() else self._train
        self.num_train_windows = int(self._train[0].size)
        self.num_eval_windows = int(self._eval[0].size)
        self.eval_disjoint = bool(eval_mask.any())
        self._perm_cache: dict[int, np.ndarray] = {}

    @functools.cached_property
    def fingerprint(self) -> str:
        """The data's identity in the run record (`trn_accum.train.tokens.fingerprint`)."""
        return fingerprint(self.meta)

    def _held_out(self, doc: np.ndarray, n_doc: int, fraction: float) -> np.ndarray:
        n_win = doc.size
        if fraction <= 0 or n_win < 2:
            return np.zeros(n_win, bool)
        docs_with_windows = np.unique(doc)
        if docs_with_windows.size >= 2:
            k = min(docs_with_windows.size - 1, max(1, round(fraction * docs_with_windows.size)))
            rng = np.random.default_rng([self.seed, 0xE7A1])
            held = rng.choice(docs_with_windows, size=k, replace=False)
            return np.isin(doc, held)
        k = min(n_win - 1, max(1, round(fraction * n_win)))
        mask = np.zeros(n_win, bool)
        mask[n_win - k :] = True
        return mask

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, 0x7EA1, epoch])
            perm = rng.permutation(self.num_train_windows)
            if len(self._perm_cache) >= 2:
                self._perm_cache.pop(min(self._perm_cache))
            self._perm_cache[epoch] = perm
        return perm

    def window_ids(self, step: int, row_indices: np.ndarray, split: str = "train") -> np.ndarray:
        """Indices (into the split's window list) of the given rows of `step`."""
        split_id = _check_split(split)
        rows = _check_rows(row_indices, self.batch_size)
        sample = int(step) * self.batch_size + rows
        if split_id == _SPLITS["eval"]:
            return sample % self.num_eval_windows
        n = self.num_train_windows
        out = np.empty(rows.size, np.int64)
        epochs = sample // n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[sample[sel] % n]
        return out

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]:
        """The given rows (indices into the global batch of `step`) as int32/float32 [n, S]."""
        rows = _check_rows(row_indices, self.batch_size)
        ids = self.window_ids(step, rows, split)
        starts, lengths = self._eval if split == "eval" else self._train
        s1 = self.seq_len + 1
        windows = np.full((ids.size, s1), self.pad_id, np.int64)
        for j, w in enumerate(ids):
            a, n = int(starts[w]), int(lengths[w])
            windows[j, :n] = self.tokens.read(a, n)
        where = f"train step {step + 1}" if split == "train" else f"eval batch {step}"
        check_ids(windows, self.model_vocab, rows=rows, where=where)
        return _assemble(windows, lengths[ids])


def make_dataset(
    kind: str,
    *,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    seed: int = 0,
    path: str | None = None,
    eval_fraction: float = 0.01,
    max_seq_len: int | None = None,
) -> SyntheticDataset | TokenDataset:
    """``kind`` "synthetic" or "tokens" (then ``path`` = prepared dir or its meta.json).

    ``vocab_size`` is the model's: synthetic ids stay below it; token data whose vocabulary is
    larger is a ``DataError``.
    """
    if kind == "synthetic":
        return SyntheticDataset(
            vocab_size=vocab_size,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            max_seq_len=max_seq_len,
        )
    if kind == "tokens":
        if not path:
            raise DataError(
                "data kind 'tokens' needs a path: set the data path to a directory written by "
                "`trn-accum prepare-data`"
            )
        return TokenDataset(
            path,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            eval_fraction=eval_fraction,
            model_vocab=vocab_size,
            max_seq_len=max_seq_len,
        )
    raise DataError(f"data kind {kind!r} is not one of {DATA_KINDS}: use one of those")


# --------------------------------------------------------------------------- global batches


def process_rows(sharding, global_shape: tuple[int, ...]) -> np.ndarray:
    """Sorted global row indices held by this process's addressable devices under `sharding`.

    This is the row order ``jax.make_array_from_process_local_data`` expects for dimension 0.
    """
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    rows: set[int] = set()
    for index in index_map.values():
        rows.update(range(*index[0].indices(global_shape[0])))
    return np.asarray(sorted(rows), dtype=np.int64)


def global_batch(
    dataset: Dataset,
    step: int,
    global_batch_size: int,
    sharding,
    split: str = "train",
) -> dict[str, Any]:
    """The [B, S] batch of `step` as jax.Arrays with `sharding` (a NamedSharding over [B, S]).

    Each process builds only the rows its addressable devices hold (``process_rows``), full
    length along S, and ``jax.make_array_from_process_local_data`` assembles the global arrays.
    """
    import jax

    if int(global_batch_size) != dataset.batch_size:
        raise DataError(
            f"global_batch_size={global_batch_size} differs from the dataset's "
            f"batch_size={dataset.batch_size}: build the dataset with the same global batch"
        )
    shape = (int(global_batch_size), dataset.seq_len)
    rows = process_rows(sharding, shape)
    local = dataset.rows(step, rows, split)
    return jax.make_array_from_process_local_data(
        {k: sharding for k in local}, local, {k: shape for k in local}
    )
