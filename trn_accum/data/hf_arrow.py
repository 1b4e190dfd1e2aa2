"""`ArrowCorpus`: a Hugging Face dataset saved with ``datasets.Dataset.save_to_disk`` read in
place, as one token stream with document boundaries, for `trn_accum.data.token_dataset.
TokenDataset`.

    DIR/state.json                  ``_data_files``: the Arrow files in order, ``_fingerprint``
    DIR/dataset_info.json           features, description (not read)
    DIR/data-0000K-of-0000N.arrow   Arrow IPC streams; the column ``input_ids`` is a list of
                                    integer token ids per row (of any length, or a fixed one)

Each Arrow file is memory-mapped (``pyarrow.memory_map``) and its record batches are read
without a copy: a row is a document, its ids a slice of the column's values buffer, read when
a batch needs its window. The id type is the column's (any integer type); the vocabulary is
checked as for a Megatron corpus (a sample at open, every host batch). A ``DatasetDict``
(``dataset_dict.json``) is refused with its split directories named; pyarrow is imported only
when such a corpus is opened.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from trn_accum.data.megatron import FileWatch, sampled_ids_check
from trn_accum.data.tokens import DataError, sampled_digest

COLUMN = "input_ids"
STATE_FILE = "state.json"
DICT_FILE = "dataset_dict.json"
FIX = "save it with datasets.Dataset.save_to_disk(DIR) and set data.path to DIR"


def _data_files(path: str) -> tuple[list[str], str]:
    """(the Arrow files `path`'s state.json names, in order, the dataset's own fingerprint)."""
    if not os.path.isdir(path):
        raise DataError(f"Hugging Face dataset {path} is not a directory: {FIX}")
    if os.path.isfile(os.path.join(path, DICT_FILE)):
        splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
        raise DataError(
            f"{path} is a DatasetDict (splits {', '.join(splits) or 'none'}): set data.path to "
            f"one split's directory, e.g. {os.path.join(path, splits[0] if splits else 'train')}"
        )
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [d["filename"] for d in state["_data_files"]]
    except FileNotFoundError:
        raise DataError(f"{path} has no {STATE_FILE}, so it was not written by {FIX}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{state_path} is not a readable save_to_disk state ({type(e).__name__}): {FIX}"
        ) from None
    files = [os.path.join(path, os.path.basename(str(n))) for n in names]
    if not files:
        raise DataError(f"{state_path} names no Arrow file: {FIX}")
    if missing := [f for f in files if not os.path.isfile(f)]:
        raise DataError(f"Arrow file {missing[0]} (named by {state_path}) does not exist: {FIX}")
    return files, str(state.get("_fingerprint", ""))


def _token_chunks(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(values, offsets) of each record batch's `input_ids` in the memory-mapped `path`:
    values a zero-copy view of the ids, offsets int64 [rows + 1] into it."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(
            "data kind 'hf' reads Arrow files with pyarrow, which is not installed: pip install "
            "'trn_accum[data]' (or pyarrow)"
        ) from None
    try:
        batches = list(pa.ipc.open_stream(pa.memory_map(path, "r")))
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"Arrow file {path} cannot be read ({e}): {FIX}") from None
    out = []
    for batch in batches:
        if COLUMN not in batch.schema.names:
            raise DataError(
                f"Arrow file {path} has no {COLUMN!r} column (it has "
                f"{', '.join(batch.schema.names)}): tokenize the dataset into {COLUMN} first"
            )
        col = batch.column(COLUMN)
        kind = col.type
        lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
        if not any(is_kind(kind) for is_kind in lists) or not pa.types.is_integer(kind.value_type):
            raise DataError(
                f"column {COLUMN!r} of {path} is {kind}, not a list of integer token ids: "
                f"tokenize the dataset into lists of ids"
            )
        if col.null_count or col.values.null_count:
            raise DataError(f"column {COLUMN!r} of {path} has null entries: drop those rows")
        values = col.values.to_numpy(zero_copy_only=True)
        if pa.types.is_fixed_size_list(kind):  # Sequence(..., length=n): rows of n ids
            offsets = (np.arange(len(col) + 1, dtype=np.int64) + col.offset) * kind.list_size
        else:
            offsets = np.asarray(col.offsets, dtype=np.int64)
        out.append((values, offsets))
    return out


class ArrowCorpus:
    """The rows of the ``input_ids`` column of the save_to_disk directory `path`, in order, as
    one stream: ``offsets`` (int64 [rows + 1]), ``read(start, count)`` (a zero-copy view),
    ``meta``, ``fingerprint``, ``check_unchanged()``. One-line DataErrors."""

    def __init__(self, path: str, model_vocab: int):
        self.path = str(path)
        self.name = f"Hugging Face dataset {self.path}"
        self.files, self._hf_fingerprint = _data_files(self.path)
        self.watch = FileWatch(self.files, "Hugging Face dataset")
        chunks = [c for f in self.files for c in _token_chunks(f)]
        chunks = [c for c in chunks if c[1].size > 1]  # record batches with rows
        if not chunks:
            raise DataError(f"{self.name} has no row: tokenize a non-empty dataset")
        dtypes = {c[0].dtype for c in chunks}
        if len(dtypes) > 1:
            raise DataError(
                f"{self.name} stores {COLUMN} as {sorted(d.name for d in dtypes)} in different "
                f"files: cast the column to one integer type and save it again"
            )
        self._values = [v for v, _ in chunks]
        self._bases = [int(o[0]) for _, o in chunks]  # a record batch's slice of its values
        sizes = [int(o[-1] - o[0]) for _, o in chunks]
        self.starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self.offsets = np.concatenate(
            [[0], *((o[1:] - o[0]) + s for (_, o), s in zip(chunks, self.starts, strict=True))]
        ).astype(np.int64)
        self.num_tokens = int(self.offsets[-1])
        if self.num_tokens == 0:
            raise DataError(f"{self.name} has only empty {COLUMN}: tokenize it first")
        for i in np.unique(np.linspace(0, len(chunks) - 1, 16, dtype=int)):  # spread batches
            values, offsets = chunks[i]
            if sizes[i]:
                ids = values[offsets[0] : offsets[-1]]
                sampled_ids_check(ids, int(model_vocab), self.name, int(self.starts[i]))
        self.meta = {
            "format": "hf.arrow/1",
            "dtype": self._values[0].dtype.name,
            "vocab_size": int(model_vocab),  # the dataset records none; checked per batch
            "pad_id": 0,
            "num_tokens": self.num_tokens,
            "num_documents": int(self.offsets.size - 1),
        }

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(b"hf.arrow/1" + self._hf_fingerprint.encode(), digest_size=16)
        for f in self.files:
            h.update(sampled_digest(f))
        return "blake2b:" + h.hexdigest()

    def read(self, start: int, count: int) -> np.ndarray:
        """ids [start, start + count) of the stream (within one record batch: any span within
        one row is), as a view of the memory-mapped values."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        a = int(start) - int(self.starts[k]) + self._bases[k]
        return self._values[k][a : a + int(count)]

    def check_unchanged(self) -> None:
        self.watch.check()
