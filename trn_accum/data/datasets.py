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
- ``TokenDataset`` over a corpus read in place: a Megatron indexed dataset (``.bin``/``.idx``,
  memory-mapped: `trn_accum.data.megatron`) or a Hugging Face dataset saved to disk (Arrow,
  memory-mapped: `trn_accum.data.hf_arrow`), its documents as stored.
- ``MixtureDataset``: several corpora drawn in exact proportions per window of samples
  (`trn_accum.data.mixture`); ``step_metrics`` gives the tokens drawn from each per step.
- ``TokenDataset``: a flat token file (uint16/uint32, read with ``os.pread``), a
  document-offsets file and a JSON sidecar (read as possibly garbage: every field is checked;
  `trn_accum.data.tokens`), written by ``trn_accum.data.prepare``, or a set of such shard
  directories read as one stream (`trn_accum.data.token_corpus`); every id of a host batch is
  checked against the model's vocabulary. Documents are cut into windows of ``seq_len + 1`` tokens
  (neighbours share one token); a short document or last window is padded (``target_mask``
  0). No packing across documents. A held-out set of documents forms the eval split.

``global_batch`` assembles the global [B, S] arrays with
``jax.make_array_from_process_local_data`` from the rows each process's devices hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from trn_accum.data.batches import assemble, check_common, check_rows, check_split
from trn_accum.data.hf_arrow import ArrowCorpus
from trn_accum.data.megatron import MegatronCorpus
from trn_accum.data.mixture import MixtureDataset, component_specs
from trn_accum.data.token_corpus import TokenCorpus
from trn_accum.data.token_dataset import TokenDataset, check_one_sequence
from trn_accum.data.tokens import DataError, check_vocab, read_meta

__all__ = [  # DataError, check_vocab and read_meta (trn_accum.data.tokens): this API too
    "BATCH_KEYS",
    "DATA_KINDS",
    "DataError",
    "Dataset",
    "SyntheticDataset",
    "TokenDataset",
    "check_vocab",
    "global_batch",
    "make_dataset",
    "MixtureDataset",
    "process_rows",
    "step_metrics",
    "read_meta",
]

BATCH_KEYS = ("input_ids", "target_labels", "target_mask")
DATA_KINDS = ("synthetic", "tokens", "megatron", "hf", "mixture")


class Dataset(Protocol):
    """What ``global_batch`` needs from a dataset."""

    seq_len: int
    batch_size: int
    vocab_size: int

    def rows(
        self, step: int, row_indices: np.ndarray, split: str = "train"
    ) -> dict[str, np.ndarray]: ...


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
        check_common(seq_len, batch_size, max_seq_len)
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
        split_id = check_split(split)
        rows = check_rows(row_indices, self.batch_size)
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
        return assemble(windows, lengths)


def make_dataset(
    kind: str,
    *,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    seed: int = 0,
    path: str | Sequence[str] | None = None,
    eval_fraction: float = 0.01,
    max_seq_len: int | None = None,
    mixture: Sequence[Mapping[str, Any]] = (),
) -> SyntheticDataset | TokenDataset | MixtureDataset:
    """``kind`` "synthetic"; "tokens" (then ``path`` = a prepared dir or its meta.json, a glob
    of shard dirs, or a list of those: `trn_accum.data.token_corpus`); "megatron" (``path`` =
    the PREFIX of PREFIX.bin/.idx: `trn_accum.data.megatron`); "hf" (``path`` = a
    save_to_disk directory: `trn_accum.data.hf_arrow`); "mixture" (``mixture`` = the
    data.mixture tables: `trn_accum.data.mixture`).

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
    common = dict(seq_len=seq_len, batch_size=batch_size, seed=seed, eval_fraction=eval_fraction)
    common.update(model_vocab=vocab_size, max_seq_len=max_seq_len)
    if kind == "mixture":
        specs = component_specs(list(mixture))
        parts = [_corpus_dataset(c["kind"], c["path"], common, True) for c in specs]
        return MixtureDataset(parts, specs)
    if mixture:
        raise DataError(
            f'data.mixture is set but data.kind is {kind!r}: set data.kind = "mixture" to draw '
            f"from its components, or remove data.mixture"
        )
    if kind in ("tokens", "megatron", "hf"):
        return _corpus_dataset(kind, path, common, kind != "tokens")
    raise DataError(f"data kind {kind!r} is not one of {DATA_KINDS}: use one of those")


_NEEDS_PATH = {
    "tokens": "a directory written by `trn-accum prepare-data` (or a glob or list of its "
    "shard directories)",
    "megatron": "the prefix of a Megatron PREFIX.bin/PREFIX.idx pair",
    "hf": "a directory written by datasets.Dataset.save_to_disk",
}


def _corpus_dataset(kind: str, path, common: dict, whole_sequence: bool) -> TokenDataset:
    """The `TokenDataset` of one corpus of `kind`; with `whole_sequence`, a corpus of fewer
    tokens than one sequence is refused."""
    if not path:
        raise DataError(
            f"data kind {kind!r} needs a path: set the data path to {_NEEDS_PATH[kind]}"
        )
    if kind != "tokens" and not isinstance(path, str):
        raise DataError(f"data kind {kind!r} reads one corpus: data.path = {path!r} names several")
    vocab = int(common["model_vocab"])
    if kind == "megatron":
        corpus = MegatronCorpus(path, vocab)
    elif kind == "hf":
        corpus = ArrowCorpus(path, vocab)
    else:
        corpus = TokenCorpus(path)
    if whole_sequence:
        check_one_sequence(corpus, common["seq_len"])
    return TokenDataset(path, corpus=corpus, **common)


def config_problem(kind: str, path: str | Sequence[str], mixture: Sequence[Any]) -> str | None:
    """The one line a [data] section's kind, path and mixture earn at load time, or None."""
    if (kind == "mixture") != bool(mixture):
        return (
            f"data.kind = {kind!r} with data.mixture = {list(mixture)!r}: a mixture needs "
            f'data.kind = "mixture" and a non-empty data.mixture (tables {{path, weight, kind}})'
        )
    if kind in _NEEDS_PATH and not path:
        return f"data.path = {path!r}: must name {_NEEDS_PATH[kind]} when data.kind = {kind!r}"
    try:
        if mixture:
            component_specs(list(mixture))
    except DataError as e:
        return str(e)
    return None


def step_metrics(dataset: Dataset, step: int) -> dict[str, float]:
    """The data fields of train step `step`'s metrics.jsonl record (0-based `step`): the target
    tokens drawn from each mixture component and, once it wraps, its epoch; {} otherwise."""
    return dataset.step_metrics(step) if isinstance(dataset, MixtureDataset) else {}


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
