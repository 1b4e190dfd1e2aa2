"""`TokenDataset`: the windows of a prepared token directory, or of a set of shard directories
read as one (`trn_accum.data.token_corpus`; written by `trn-accum prepare-data`), as the rows
of global batches: documents cut into windows of seq_len + 1 tokens, a seeded held-out set of
documents for eval, a seeded order per epoch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trn_accum.data.batches import SPLITS, assemble, check_common, check_rows, check_split
from trn_accum.data.token_corpus import TokenCorpus
from trn_accum.data.tokens import DataError, check_ids, check_vocab


def document_windows(
    offsets: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    """Windows of the prepared token directories `path` names (a directory, a glob or a list:
    `TokenCorpus`), read with ``os.pread``; every id of a host batch is checked against the
    model's vocabulary (`check_ids`).

    Train rows: sample ``i = step * batch_size + row`` of an endless stream that visits every
    train window once per epoch, in an order permuted with ``(seed, epoch)``. Eval rows: the
    held-out windows in order, ``(step * batch_size + row) mod n_eval``. Held out: a seeded
    choice of ``max(1, round(eval_fraction * documents))`` documents when there are at least two,
    else the last windows of the only document, else (a single window) the train window itself.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        eval_fraction: float = 0.01,
        model_vocab: int | None = None,
        max_seq_len: int | None = None,
    ):
        check_common(seq_len, batch_size, max_seq_len)
        corpus = TokenCorpus(path)
        meta = corpus.meta
        if model_vocab is not None:
            check_vocab(meta, model_vocab)
        self.meta = meta
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.vocab_size = int(meta["vocab_size"])
        self.pad_id = int(meta.get("pad_id", meta["eos_id"]))
        n_doc = int(meta["num_documents"])
        self.model_vocab = int(model_vocab) if model_vocab is not None else self.vocab_size
        self.tokens = corpus
        offsets = corpus.offsets
        start, length, doc = document_windows(offsets, self.seq_len)
        if start.size == 0:
            raise DataError(
                f"token data {corpus.name} has no document of 2 or more tokens, so no "
                f"training window: prepare it from non-empty text files"
            )
        eval_mask = self._held_out(doc, n_doc, float(eval_fraction))
        self._train = (start[~eval_mask], length[~eval_mask])
        self._eval = (start[eval_mask], length[eval_mask]) if eval_mask.any() else self._train
        self.num_train_windows = int(self._train[0].size)
        self.num_eval_windows = int(self._eval[0].size)
        self.eval_disjoint = bool(eval_mask.any())
        self._perm_cache: dict[int, np.ndarray] = {}

    @property
    def fingerprint(self) -> str:
        """The data's identity in the run record (`TokenCorpus.fingerprint`)."""
        return self.tokens.fingerprint

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
        split_id = check_split(split)
        rows = check_rows(row_indices, self.batch_size)
        sample = int(step) * self.batch_size + rows
        if split_id == SPLITS["eval"]:
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
        rows = check_rows(row_indices, self.batch_size)
        ids = self.window_ids(step, rows, split)
        starts, lengths = self._eval if split == "eval" else self._train
        s1 = self.seq_len + 1
        windows = np.full((ids.size, s1), self.pad_id, np.int64)
        for j, w in enumerate(ids):
            a, n = int(starts[w]), int(lengths[w])
            windows[j, :n] = self.tokens.read(a, n)
        where = f"train step {step + 1}" if split == "train" else f"eval batch {step}"
        check_ids(windows, self.model_vocab, rows=rows, where=where)
        return assemble(windows, lengths[ids])
