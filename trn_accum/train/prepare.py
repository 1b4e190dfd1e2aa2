"""`trn-accum prepare-data`: tokenize text files into the token directory `TokenDataset` reads.

    prepare_data(["a.txt", "b.jsonl"], "data/tok", tokenizer="bytes")

writes `tokens.bin` (uint16/uint32 ids), `offsets.npy` (document boundaries) and `meta.json`
(`trn_accum.train.tokens.read_meta` checks them on load).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from trn_accum.train.sniff import HEAD_BYTES, MAX_CONTROL_FRACTION, archive_kind, control_fraction
from trn_accum.train.tokens import (
    BYTES_EOS_ID,
    BYTES_VOCAB_SIZE,
    FORMAT,
    META_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    DataError,
)

_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class _BytesTokenizer:
    name = "bytes"
    vocab_size = BYTES_VOCAB_SIZE
    eos_id = BYTES_EOS_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)


class _HFTokenizer:
    def __init__(self, path: str):
        if not os.path.exists(path):
            raise DataError(
                f"tokenizer {path!r} is neither 'bytes' nor an existing tokenizer.json file: "
                f"pass --tokenizer bytes or the path of a HuggingFace tokenizer.json"
            )
        try:
            import tokenizers
        except ImportError:
            raise DataError(
                f"tokenizer {path} needs the `tokenizers` package, which is not installed: "
                f"`pip install tokenizers` or use --tokenizer bytes"
            ) from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust loader raises a bare Exception
            raise DataError(
                f"tokenizer {path} cannot be loaded ({str(e).splitlines()[0][:120]}): pass a "
                f"HuggingFace tokenizer.json"
            ) from None
        self.name = os.path.abspath(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        eos = next(
            (i for t in _EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None
        )
        if eos is None:
            raise DataError(
                f"tokenizer {path} has none of the end-of-text tokens {list(_EOS_CANDIDATES)}: "
                f"add one to the tokenizer"
            )
        self.eos_id = int(eos)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.uint32)


def _check_text_file(path: str) -> None:
    if os.path.isdir(path):
        raise DataError(
            f"text file {path} is a directory: pass the text files in it (e.g. {path}/*.txt)"
        )
    if not os.path.isfile(path):
        raise DataError(f"text file {path} does not exist: pass existing text files")


def _refuse_archive(path: str) -> None:
    """A DataError when `path` starts with an archive's or a compressor's magic bytes."""
    try:
        with open(path, "rb") as f:
            kind = archive_kind(f.read(HEAD_BYTES))
    except OSError as e:
        raise DataError(f"text file {path} cannot be read ({e.strerror})") from None
    if kind is not None:
        raise DataError(
            f"text file {path} is a {kind} archive or compressed file, not text: unpack it and "
            f"pass the text files in it (or --binary-ok to tokenize its bytes as they are)"
        )


def _refuse_binary_text(path: str, text: str) -> None:
    share = control_fraction(text)
    if share > MAX_CONTROL_FRACTION:
        raise DataError(
            f"text file {path} is {share:.1%} NUL or control characters (more than "
            f"{MAX_CONTROL_FRACTION:.0%}): it looks binary, not text; pass text files (or "
            f"--binary-ok to tokenize it as it is)"
        )


def _documents(path: str):
    """Yield the documents of one text file: the whole file, or one per JSONL line's "text"."""
    _check_text_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        text = record["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(
                            f"{path}:{lineno} is not a JSON object with a 'text' field: fix the "
                            f"line or pass plain .txt files"
                        ) from None
                    yield str(text)
            else:
                yield f.read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"text file {path} is not UTF-8 (byte {e.start}): convert it to UTF-8"
        ) from None


def prepare_data(
    text_files: list[str], out_dir: str, tokenizer: str = "bytes", *, binary_ok: bool = False
) -> dict:
    """Tokenize text files into ``out_dir/{tokens.bin, offsets.npy, meta.json}``.

    A ``.jsonl`` file contributes one document per line (its "text" field); any other file is one
    document. Every document is followed by the tokenizer's end-of-text id. ``tokenizer`` is
    "bytes" (UTF-8 bytes 0..255, eos 256, vocab 257) or the path of a HuggingFace
    ``tokenizer.json`` (needs the ``tokenizers`` package). Tokens are stored as uint16 when the
    vocabulary fits, else uint32. Empty documents are skipped. Returns the metadata written.
    Unless ``binary_ok``, an archive or compressed file (by its magic bytes) and a document
    more than ``sniff.MAX_CONTROL_FRACTION`` NUL/control characters are refused (DataError
    naming the file) before anything is kept in ``out_dir``.
    """
    if not text_files:
        raise DataError("no text files given: pass one or more text files to prepare")
    tok = _BytesTokenizer() if tokenizer == "bytes" else _HFTokenizer(tokenizer)
    for p in text_files:
        _check_text_file(p)
        if not binary_ok:
            _refuse_archive(p)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"output directory {out_dir} cannot be created ({e.strerror}): choose a writable --out"
        ) from None
    tokens_path = os.path.join(out_dir, TOKENS_FILE)
    tmp_tokens = tokens_path + ".tmp"
    offsets = [0]
    max_id = -1
    digest = hashlib.blake2b(digest_size=16)  # the content's identity (tokens.fingerprint)
    try:
        with open(tmp_tokens, "wb") as out:
            for p in text_files:
                for text in _documents(p):
                    if not text:
                        continue
                    if not binary_ok:
                        _refuse_binary_text(p, text)
                    ids = tok.encode(text)
                    ids = np.concatenate([ids, np.asarray([tok.eos_id], np.uint32)])
                    max_id = max(max_id, int(ids.max()))
                    raw = ids.astype(dtype).tobytes()
                    out.write(raw)
                    digest.update(raw)
                    offsets.append(offsets[-1] + int(ids.size))
    except OSError as e:
        _remove(tmp_tokens)
        raise DataError(
            f"cannot write {tmp_tokens} ({e.strerror}): choose a writable --out"
        ) from None
    except BaseException:  # a bad document, Ctrl-C: no half-written token file is left
        _remove(tmp_tokens)
        raise
    if len(offsets) == 1:
        _remove(tmp_tokens)
        raise DataError(
            f"the corpus {list(text_files)} is empty (no non-empty document): pass text files "
            f"with content"
        )
    try:
        os.replace(tmp_tokens, tokens_path)
        np.save(os.path.join(out_dir, OFFSETS_FILE), np.asarray(offsets, dtype=np.int64))
    except OSError as e:
        _remove(tmp_tokens)
        raise DataError(
            f"cannot write into {out_dir} ({e.strerror}): choose a writable --out"
        ) from None
    meta = {
        "format": FORMAT,
        "dtype": np.dtype(dtype).name,
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "pad_id": int(tok.eos_id),
        "max_token_id": max_id,
        "tokens_blake2b": digest.hexdigest(),
        "num_tokens": offsets[-1],
        "num_documents": len(offsets) - 1,
        "tokens_file": TOKENS_FILE,
        "offsets_file": OFFSETS_FILE,
        "tokenizer": tok.name,
        "sources": [os.path.abspath(p) for p in text_files],
    }
    meta_path = os.path.join(out_dir, META_FILE)
    try:
        with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        os.replace(meta_path + ".tmp", meta_path)
    except OSError as e:
        _remove(meta_path + ".tmp")
        raise DataError(
            f"cannot write {meta_path} ({e.strerror}): choose a writable --out"
        ) from None
    return meta


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
