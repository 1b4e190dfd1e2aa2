"""The prepared token directory `trn-accum prepare-data` writes and `TokenDataset` reads.

    DIR/tokens.bin    the token ids, uint16 (vocabulary <= 65536) or uint32, documents back to back
    DIR/offsets.npy   int64 [documents + 1], document boundaries in tokens
    DIR/meta.json     the sidecar: format, dtype, vocab_size, eos/pad ids, max_token_id,
                      num_tokens, num_documents, file names, tokenizer (its path and digest),
                      a content hash, and sampled digests of both files (`sample_blake2b`)

Everything read here is treated as possibly garbage or changed under us: `read_meta` checks
every field, the file sizes, the permissions and, where the sidecar records them, the sampled
digests of both files taken when they were written (so a file that is not the one the sidecar
vouches for, e.g. another run's, is refused; one-line `DataError`s naming the file, the rule
and a fix); `TokenFile` reads windows with `os.pread`, so a file that shrinks under a
running trainer is a short read (a `DataError`), not the SIGBUS a memory map would raise;
`fingerprint` is the data's identity in the run record (`trn_accum.config.drift`), cheap on
large files: the sidecar, both file sizes and sampled blocks of both files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from trn_accum.errors import UserError

FORMAT = "trn_accum.tokens/1"
META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
BYTES_EOS_ID = 256
BYTES_VOCAB_SIZE = 257
#: the fingerprint reads this many evenly spaced blocks of this size from each file
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_BYTES = 1 << 16
#: sidecar fields that are not the data's identity (where it was prepared from)
_NOT_IDENTITY = ("sources", "shard", "tokens_path", "offsets_path")


class DataError(UserError):
    """A user-caused data problem; the message is one line: value, rule, fix."""


def _unreadable(path: str, e: OSError, what: str) -> DataError:
    if isinstance(e, PermissionError):
        return DataError(
            f"{what} {path} is not readable by this user (permission denied): fix its "
            f"permissions (chmod/chown) or point the data path at a readable copy"
        )
    return DataError(f"{what} {path} cannot be read ({e.strerror or e}): restore it")


def _resolve_meta_path(path: str) -> str:
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise _unreadable(path, PermissionError(), "token data directory")
        return os.path.join(path, META_FILE)
    return path


_META_INTS = {"vocab_size": 1, "eos_id": 0, "num_tokens": 0, "num_documents": 0}
_META_OPTIONAL_INTS = {"max_token_id": -1, "pad_id": 0}


def _check_meta_fields(meta: Any, meta_path: str) -> None:
    """DataError for a missing field, or one of the wrong type or range (garbage, foreign)."""
    fix = "re-run `trn-accum prepare-data`"
    required = ("dtype", *_META_INTS)
    if missing := [k for k in required if not isinstance(meta, dict) or k not in meta]:
        raise DataError(f"token metadata {meta_path} lacks {', '.join(missing)}: {fix}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"token dtype {meta['dtype']!r} in {meta_path} is not uint16/uint32: {fix}")
    bad = [
        (k, v, f"an integer >= {low}")
        for k, low in (*_META_INTS.items(), *_META_OPTIONAL_INTS.items())
        if type(v := meta.get(k, low)) is not int or v < low
    ]
    bad += [
        (k, v, "a file name beside it")
        for k in ("tokens_file", "offsets_file")
        if not isinstance(v := meta.get(k, "x"), str) or not v or os.path.basename(v) != v
    ]
    if bad:
        key, value, rule = bad[0]
        raise DataError(
            f"token metadata {meta_path}: {key} = {value!r} is not {rule} (damaged or "
            f"foreign file): {fix}"
        )


def read_meta(path: str) -> dict[str, Any]:
    """The JSON sidecar at `path` (a prepared directory or its meta.json), validated (every
    field; both files exist and are readable; the token file holds exactly ``num_tokens``
    tokens of ``dtype``), with absolute ``tokens_path`` and ``offsets_path`` added. DataError
    otherwise."""
    meta_path = _resolve_meta_path(path)
    parent = os.path.dirname(os.path.abspath(meta_path))
    if not os.access(parent, os.X_OK):
        raise _unreadable(parent, PermissionError(), "token data directory")
    if not os.path.exists(meta_path):
        raise DataError(
            f"token data {meta_path} does not exist: run `trn-accum prepare-data TEXT_FILES "
            f"--out DIR` and point the data path at DIR"
        )
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise _unreadable(meta_path, e, "token metadata") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"token metadata {meta_path} is not readable JSON ({type(e).__name__}): "
            f"re-run `trn-accum prepare-data`"
        ) from None
    _check_meta_fields(meta, meta_path)
    tokens_path = os.path.join(parent, meta.get("tokens_file", TOKENS_FILE))
    offsets_path = os.path.join(parent, meta.get("offsets_file", OFFSETS_FILE))
    if missing := [p for p in (tokens_path, offsets_path) if not os.path.isfile(p)]:
        raise DataError(
            f"token data file {missing[0]} (named by {meta_path}) does not exist: re-run "
            f"`trn-accum prepare-data` or restore the file"
        )
    if unreadable := [p for p in (tokens_path, offsets_path) if not os.access(p, os.R_OK)]:
        raise _unreadable(unreadable[0], PermissionError(), "token data file")
    expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    if (actual := os.path.getsize(tokens_path)) != expected:
        raise DataError(
            f"token file {tokens_path} has {actual} bytes but {meta_path} says "
            f"{meta['num_tokens']} {meta['dtype']} tokens = {expected} bytes (truncated or "
            f"replaced): re-run `trn-accum prepare-data`"
        )
    _check_samples(meta, meta_path, tokens_path, offsets_path)
    if meta["num_tokens"] == 0 or meta["num_documents"] == 0:
        raise DataError(
            f"token data {meta_path} is empty ({meta['num_tokens']} tokens, "
            f"{meta['num_documents']} documents): prepare it from non-empty text files"
        )
    return {**meta, "tokens_path": tokens_path, "offsets_path": offsets_path}


def _check_samples(meta: dict, meta_path: str, tokens_path: str, offsets_path: str) -> None:
    """DataError when a file's sampled digest differs from the one `meta_path` recorded."""
    recorded = meta.get("sample_blake2b")
    if recorded is None:  # written before sidecars recorded them: the sizes were checked
        return
    if not isinstance(recorded, dict):
        raise DataError(
            f"token metadata {meta_path}: sample_blake2b = {recorded!r} is not a mapping "
            f"(damaged or foreign file): re-run `trn-accum prepare-data`"
        )
    for key, path in (("tokens", tokens_path), ("offsets", offsets_path)):
        if sampled_digest(path).hex() != recorded.get(key):
            raise DataError(
                f"token data file {path} is not the one {meta_path} was written with (its "
                f"sampled digest differs: changed, or written by another run): re-run "
                f"`trn-accum prepare-data`"
            )


def check_vocab(meta: Mapping[str, Any], model_vocab: int) -> None:
    """Raise ``DataError`` when the data's token ids can reach past the model's vocabulary."""
    data_vocab = int(meta["vocab_size"])
    max_id = int(meta.get("max_token_id", data_vocab - 1))
    if data_vocab > int(model_vocab) or max_id >= int(model_vocab):
        raise DataError(
            f"data vocab_size={data_vocab} (max token id {max_id}) is larger than the model's "
            f"vocab_size={model_vocab}: raise the model's vocab_size to at least "
            f"{max(data_vocab, max_id + 1)} or prepare the data with a smaller tokenizer"
        )


class TokenFile:
    """Token ids read with ``os.pread`` from an open ``tokens.bin`` of `num_tokens` ids of
    `dtype`. A read past the current end (the file shrank or was replaced under the trainer)
    is a one-line DataError naming the file and both sizes."""

    def __init__(self, path: str, dtype: str, num_tokens: int):
        self.path, self.dtype, self.num_tokens = path, np.dtype(dtype), int(num_tokens)
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _unreadable(path, e, "token file") from None

    def read(self, start: int, count: int) -> np.ndarray:
        """ids [start, start + count) as a 1-D array of the file's dtype."""
        size = self.dtype.itemsize
        try:
            raw = os.pread(self._fd, int(count) * size, int(start) * size)
        except OSError as e:
            raise _unreadable(self.path, e, "token file") from None
        if len(raw) != int(count) * size:
            now = os.fstat(self._fd).st_size
            raise DataError(
                f"token file {self.path} shrank under the trainer: it had "
                f"{self.num_tokens * size} bytes at start, {now} now (rewritten or truncated "
                f"while training): restore it and resume (the last checkpoint is intact)"
            )
        return np.frombuffer(raw, self.dtype)

    def close(self, _close=os.close) -> None:  # bound early: `os` may be gone at exit
        if self._fd >= 0:
            _close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


def check_ids(ids: np.ndarray, model_vocab: int, *, rows: np.ndarray, where: str) -> None:
    """DataError naming the first id >= `model_vocab` of `ids` [n, L] (rows `rows` of the
    global batch `where` names, e.g. "train step 7"), its row and position. One max over the
    host array when every id is in range."""
    if ids.size == 0 or int(ids.max()) < model_vocab:
        return
    bad = np.argwhere(ids >= model_vocab)
    if bad.size:
        r, pos = (int(v) for v in bad[0])
        raise DataError(
            f"token id {int(ids[r, pos])} in {where}, row {int(rows[r])}, position {pos} is "
            f"outside the model's vocab_size={model_vocab} ({bad.shape[0]} "
            f"such ids in this host's batch): the data's vocabulary does not match the model; "
            f"re-prepare the data with the model's tokenizer or raise model.vocab_size"
        )


def sampled_digest(path: str) -> bytes:
    """blake2b of the size and SAMPLE_BLOCKS evenly spaced blocks (the whole file if smaller)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(size.to_bytes(8, "little"))
            if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
                h.update(f.read())
            else:
                last = size - SAMPLE_BLOCK_BYTES
                for i in range(SAMPLE_BLOCKS):
                    f.seek(last * i // (SAMPLE_BLOCKS - 1))
                    h.update(f.read(SAMPLE_BLOCK_BYTES))
    except OSError as e:
        raise _unreadable(path, e, "token data file") from None
    return h.digest()


def fingerprint(meta: Mapping[str, Any]) -> str:
    """The identity of prepared data (`read_meta`'s output): the sidecar's fields but where it
    came from (`sources`), and sampled digests of tokens.bin and offsets.npy. A change of
    content the samples miss is still caught when the sidecar changes (its `tokens_blake2b`,
    num_tokens, num_documents, max_token_id)."""
    ident = {k: v for k, v in meta.items() if k not in _NOT_IDENTITY}
    h = hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=16)
    h.update(sampled_digest(meta["tokens_path"]))
    h.update(sampled_digest(meta["offsets_path"]))
    return "blake2b:" + h.hexdigest()
