"""`MegatronCorpus`: a Megatron-LM indexed dataset (the ``PREFIX.bin`` + ``PREFIX.idx`` pair,
index magic ``MMIDIDX``, that ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``
and Megatron's ``preprocess_data.py`` write) read in place, as one token stream with document
boundaries, for `trn_accum.data.token_dataset.TokenDataset`.

    PREFIX.idx   b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count S <Q,
                 document count D <Q, int32 lengths [S], int64 byte pointers [S], int64
                 document indices [D] (sequence indices, 0 first, S last), int8 modes [S]
                 (multimodal files only; ignored)
    PREFIX.bin   the tokens of every sequence back to back, of the index's dtype

Both files are memory-mapped (``np.memmap``): nothing is copied at open, a window is read
from the page cache when its batch is built. A document is the run of sequences between two
document indices, kept as stored (one window list per document, no packing across them). The
token dtype is the index's; every host batch's ids are checked against the model's vocabulary
as for prepared data, and at open a sample of the tokens (`SAMPLE_BLOCKS` spread blocks) is,
so a corpus from a larger tokenizer is refused before anything compiles.

Also here, shared with `trn_accum.data.hf_arrow`: `FileWatch` (a file replaced, truncated or
rewritten under a running job is a one-line DataError at the next batch, before the memory map
is read past its end), `sampled_ids_check` and `tokens.sampled_digest` (the corpus's identity).
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

from trn_accum.data.tokens import DataError, sampled_digest

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
#: Megatron's DType codes; float codes are not token ids
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FLOAT_CODES = {6: "float64", 7: "float32"}
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_ITEMS = 1 << 15


class FileWatch:
    """The identity (device, inode, size, mtime) of files read in place, taken at open.
    ``check()`` re-reads it: DataError naming the first file that changed."""

    def __init__(self, paths: list[str], what: str):
        self.what = what
        self.stats = {p: self._stat(p) for p in paths}

    def _stat(self, path: str) -> tuple[int, int, int, int]:
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(
                f"{self.what} file {path} cannot be read ({e.strerror or e}): restore it"
            ) from None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        for path, before in self.stats.items():
            try:
                now = self._stat(path)
            except DataError:
                now = None
            if now != before:
                how = "removed" if now is None else f"{before[2]} bytes at start, {now[2]} now"
                raise DataError(
                    f"{self.what} file {path} changed under the running job ({how}; replaced, "
                    f"truncated or rewritten): restore it and resume (the last checkpoint is "
                    f"intact)"
                )


def sampled_ids_check(tokens: np.ndarray, model_vocab: int, name: str, first: int = 0) -> None:
    """DataError when evenly spaced blocks of the 1-D `tokens` (the stream's tokens from
    `first` on) hold an id outside [0, model_vocab): the corpus was tokenized for another
    (larger) vocabulary."""
    n = tokens.size
    starts = np.unique(np.linspace(0, max(0, n - SAMPLE_BLOCK_ITEMS), SAMPLE_BLOCKS, dtype=int))
    for a in starts:
        block = tokens[a : a + SAMPLE_BLOCK_ITEMS]
        lo, hi = int(block.min()), int(block.max())
        if lo < 0 or hi >= model_vocab:
            bad = lo if lo < 0 else hi
            pos = first + int(a) + int(np.argmax(block == bad))
            raise DataError(
                f"{name} holds token id {bad} (token {pos}) outside the model's vocab_size="
                f"{model_vocab}: it was tokenized for another vocabulary; raise model.vocab_size "
                f"or use a corpus made with the model's tokenizer"
            )


def _prefix(path: str) -> str:
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def _read_header(idx: str) -> tuple[np.dtype, int, int]:
    fix = "rebuild it with Megatron's preprocess_data.py or IndexedDatasetBuilder"
    try:
        with open(idx, "rb") as f:
            raw = f.read(HEADER.size)
    except OSError as e:
        raise DataError(
            f"Megatron index {idx} cannot be read ({e.strerror or e}): restore it"
        ) from None
    if len(raw) < HEADER.size or raw[:9] != MAGIC:
        raise DataError(f"{idx} is not a Megatron index (no {MAGIC[:7].decode()} header): {fix}")
    _, version, code, n_seq, n_doc = HEADER.unpack(raw)
    if version != 1:
        raise DataError(f"Megatron index {idx} has version {version}, not 1: {fix}")
    if code in FLOAT_CODES:
        raise DataError(
            f"Megatron index {idx} stores {FLOAT_CODES[code]} values, not token ids (dtype code "
            f"{code}): point data.path at a tokenized corpus"
        )
    if code not in DTYPE_CODES:
        raise DataError(f"Megatron index {idx} has an unknown dtype code {code}: {fix}")
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc


class MegatronCorpus:
    """The documents of ``PREFIX.bin``/``PREFIX.idx`` (`path` = the prefix, or either file)
    as one stream: ``offsets`` (int64 [documents + 1]), ``read(start, count)`` (a view of the
    memory map), ``meta`` (what `TokenDataset` reads), ``fingerprint``, ``check_unchanged()``.
    Every problem is a one-line DataError naming the file, the rule and a fix."""

    def __init__(self, path: str, model_vocab: int):
        prefix = _prefix(str(path))
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        self.name = f"Megatron data {prefix}"
        if not os.path.isfile(self.bin_path):
            raise DataError(
                f"Megatron data {self.bin_path} does not exist: set data.path to the prefix of "
                f"a PREFIX.bin/PREFIX.idx pair (without the extension)"
            )
        if not os.path.isfile(self.idx_path):
            raise DataError(
                f"Megatron data {self.bin_path} has no index {self.idx_path} beside it: copy the "
                f".idx written with the .bin next to it (same prefix)"
            )
        self.dtype, n_seq, n_doc = _read_header(self.idx_path)
        self.watch = FileWatch([self.bin_path, self.idx_path], "Megatron data")
        index = np.memmap(self.idx_path, np.uint8, mode="r")
        lengths, pointers, docs = self._arrays(index, n_seq, n_doc)
        self.num_tokens = self._check_layout(lengths, pointers, docs)
        try:
            self.tokens = np.memmap(self.bin_path, self.dtype, mode="r", shape=(self.num_tokens,))
        except OSError as e:
            raise DataError(
                f"Megatron data {self.bin_path} cannot be read ({e.strerror or e}): fix its "
                f"permissions or restore it"
            ) from None
        starts = np.append(pointers // self.dtype.itemsize, self.num_tokens)
        self.offsets = starts[docs].astype(np.int64)
        self.offsets[-1] = self.num_tokens
        sampled_ids_check(self.tokens, int(model_vocab), self.name)
        self.meta = {
            "format": "megatron.mmidx/1",
            "dtype": self.dtype.name,
            "vocab_size": int(model_vocab),  # the index records none; checked per batch
            "pad_id": 0,
            "num_tokens": self.num_tokens,
            "num_documents": int(self.offsets.size - 1),
        }

    def _arrays(self, index: np.ndarray, n_seq: int, n_doc: int):
        plain = HEADER.size + 12 * n_seq + 8 * n_doc
        if index.size not in (plain, plain + n_seq) or n_doc < 1:
            raise DataError(
                f"Megatron index {self.idx_path} has {index.size} bytes but its header counts "
                f"{n_seq} sequences and {n_doc - 1} documents ({plain} bytes): the file is "
                f"truncated or not this format; rebuild it"
            )
        at = HEADER.size
        lengths = np.frombuffer(index, np.int32, n_seq, at)
        pointers = np.frombuffer(index, np.int64, n_seq, at + 4 * n_seq)
        docs = np.frombuffer(index, np.int64, n_doc, at + 12 * n_seq)
        return lengths, pointers, docs

    def _check_layout(self, lengths, pointers, docs) -> int:
        """The token count; DataError unless the sequences lie back to back from byte 0 and
        end where the .bin does, and the document indices run 0..S without decreasing."""
        size = self.dtype.itemsize
        ends = np.cumsum(lengths, dtype=np.int64) * size
        expect = np.concatenate([[0], ends[:-1]]) if lengths.size else ends
        n_seq = lengths.size
        if (
            docs[0] != 0
            or docs[-1] != n_seq
            or np.any(np.diff(docs) < 0)
            or np.any(lengths < 0)
            or not np.array_equal(pointers, expect)
        ):
            raise DataError(
                f"Megatron index {self.idx_path} does not describe {n_seq} sequences stored "
                f"back to back in documents 0..{n_seq} (damaged or written by another tool): "
                f"rebuild it"
            )
        total = int(ends[-1]) if n_seq else 0
        actual = os.path.getsize(self.bin_path)
        if actual != total:
            raise DataError(
                f"Megatron data {self.bin_path} has {actual} bytes but {self.idx_path} counts "
                f"{total // size} {self.dtype.name} tokens = {total} bytes (truncated, or the "
                f".idx of another .bin): restore the pair written together"
            )
        if total == 0:
            raise DataError(f"Megatron data {self.bin_path} holds no token: rebuild it")
        return total // size

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(b"megatron.mmidx/1", digest_size=16)
        h.update(sampled_digest(self.idx_path))
        h.update(sampled_digest(self.bin_path))
        return "blake2b:" + h.hexdigest()

    def read(self, start: int, count: int) -> np.ndarray:
        """ids [start, start + count) of the stream: a view of the memory map."""
        return self.tokens[int(start) : int(start) + int(count)]

    def check_unchanged(self) -> None:
        self.watch.check()
