"""`TokenDataset`: the windows of a token corpus as the rows of global batches: documents cut
into windows of seq_len + 1 tokens, a seeded held-out set of documents for eval, a seeded order
per epoch. The corpus is a prepared token directory, or a set of shard directories read as one
(`trn_accum.data.token_corpus`; written by `trn-accum prepare-data`), or one read in place
(`trn_accum.data.megatron`, `trn_accum.data.hf_arrow`): any `Corpus`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from trn_accum.data.batches import SPLITS, assemble, check_common, check_rows, check_split
from trn_accum.data.token_corpus import TokenCorpus
from trn_accum.data.tokens import DataError, check_ids, check_vocab


class Corpus(Protocol):
    """What `TokenDataset` reads: a token stream with document boundaries (`TokenCorpus`,
    `trn_accum.data.megatron.MegatronCorpus`, `trn_accum.data.hf_arrow.ArrowCorpus`)."""

    name: str
    meta: dict  # dtype, vocab_size, num_documents, pad_id or eos_id, num_tokens
    offsets: np.ndarray  # int64 [documents + 1]
    fingerprint: str

    def read(self, start: int, count: int) -> np.ndarray: ...


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
    `TokenCorpus`, read with ``os.pread``), or of `corpus` when given (then `path` is unused);
    every id of a host batch is checked against the model's vocabulary (`check_windows`).

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
        corpus: Corpus | None = None,
    ):
        check_common(seq_len, batch_size, max_seq_len)
        corpus = TokenCorpus(path) if corpus is None else corpus
        meta = corpus.meta
        if model_vocab is not None:
            check_vocab(meta, model_vocab)
        self.meta = meta
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.vocab_size = int(meta["vocab_size"])
        self.pad_id = int(meta.get("pad_id", meta.get("eos_id", 0)))
        self._signed = np.dtype(meta["dtype"]).kind == "i"  # a foreign corpus's ids may be < 0
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
        check_split(split)
        rows = check_rows(row_indices, self.batch_size)
        return self.sample_ids(int(step) * self.batch_size + rows, split)

    def sample_ids(self, sample: np.ndarray, split: str = "train") -> np.ndarray:
        """Indices (into the split's window list) of samples `sample` (int64) of the split's
        endless stream: train sample i is window ``permutation(i // n)[i % n]``."""
        if check_split(split) == SPLITS["eval"]:
            return sample % self.num_eval_windows
        n = self.num_train_windows
        out = np.empty(sample.size, np.int64)
        epochs = sample // n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[sample[sel] % n]
        return out

    def window_lengths(self, ids: np.ndarray, split: str = "train") -> np.ndarray:
        """The real tokens (<= seq_len + 1) of windows `ids` of `split`."""
        return (self._eval if split == "eval" else self._train)[1][ids]

    def read_windows(self, ids: np.ndarray, split: str = "train") -> np.ndarray:
        """Windows `ids` of `split` as int64 [n, seq_len + 1], padded with pad_id."""
        if (unchanged := getattr(self.tokens, "check_unchanged", None)) is not None:
            unchanged()  # a corpus read in place (memory-mapped): not changed under the job
        starts, lengths = self._eval if split == "eval" else self._train
        windows = np.full((ids.size, self.seq_len + 1), self.pad_id, np.int64)
        for j, w in enumerate(ids):
            a, n = int(starts[w]), int(lengths[w])
            windows[j, :n] = self.tokens.read(a, n)
        return windows

    def check_windows(self, windows: np.ndarray, rows: np.ndarray, where: str) -> None:
        """DataError naming the first id of `windows` outside the model's vocabulary."""
        check_ids(windows, self.model_vocab, rows=rows, where=where)
        if self._signed and windows.size and int(windows.min()) < 0:
            r, pos = (int(v) for v in np.argwhere(windows < 0)[0])
            raise DataError(
                f"token id {int(windows[r, pos])} in {where}, row {int(rows[r])}, position "
                f"{pos} is negative, not a token id: re-tokenize {self.tokens.name}"
            )

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]:
        """The given rows (indices into the global batch of `step`) as int32/float32 [n, S]."""
        rows = check_rows(row_indices, self.batch_size)
        ids = self.window_ids(step, rows, split)
        windows = self.read_windows(ids, split)
        where = f"train step {step + 1}" if split == "train" else f"eval batch {step}"
        self.check_windows(windows, rows, where)
        return assemble(windows, self.window_lengths(ids, split))


def check_one_sequence(corpus: Corpus, seq_len: int) -> None:
    """DataError when `corpus` holds fewer tokens than one sequence (seq_len + 1)."""
    n = int(corpus.meta["num_tokens"])
    if n < int(seq_len) + 1:
        raise DataError(
            f"{corpus.name} holds {n} tokens, fewer than one sequence of data.seq_len + 1 = "
            f"{int(seq_len) + 1}: use a larger corpus or a shorter data.seq_len"
        )
