"""`trn-accum prepare-data`: tokenize corpus files into the token directory `TokenDataset` reads.

    prepare_data(["a.txt", "b.jsonl.zst", "c.parquet"], "data/tok", tokenizer="bytes")

writes `tokens.bin` (uint16/uint32 ids), `offsets.npy` (document boundaries) and `meta.json`
(`trn_accum.data.tokens.read_meta` checks them on load). The input is streamed
(`corpus_read`) and tokenized across worker processes in input order (`corpus_encode`):
memory stays bounded whatever the corpus size, and the output is the same bytes at any
number of workers.

Everything is written to temporary files first; `meta.json`, the mark of a complete
directory, is removed before the new files take their names and written last, so a
prepare-data killed at any point never leaves a directory that looks complete but is not.
A rerun starts over (`interrupted_files` names what a killed run left behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np

from trn_accum.data.corpus_encode import (
    EncodeSpec,
    default_workers,
    encode_ordered,
    load_tokenizer,
)
from trn_accum.data.corpus_read import CHUNK_BYTES, check_input, tasks
from trn_accum.data.progress import Progress
from trn_accum.data.tokens import FORMAT, META_FILE, OFFSETS_FILE, TOKENS_FILE, DataError

_TMP = ".tmp"
#: offsets as raw int64 while they stream in; offsets.npy is written from it at the end
_RAW_OFFSETS = "offsets.int64"


def _tmp_names() -> tuple[str, ...]:
    return tuple(n + _TMP for n in (TOKENS_FILE, OFFSETS_FILE, _RAW_OFFSETS, META_FILE))


def interrupted_files(out_dir: str) -> list[str]:
    """The temporary files a killed prepare-data left in `out_dir` (a rerun replaces them)."""
    return [n for n in _tmp_names() if os.path.exists(os.path.join(out_dir, n))]


def parse_shard(text: str) -> tuple[int, int]:
    """ "I/N" -> (I, N), 0 <= I < N: the I-th (from 0) of N parts of the input."""
    index, _, count = str(text).partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise DataError(
            f"--shard {text!r} is not I/N with 0 <= I < N: pass e.g. --shard 0/4 ... 3/4 "
            f"(in a Slurm array: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)"
        )
    return i, n


def shard_files(paths: list[str], index: int, count: int) -> list[str]:
    """The files of part `index` of `count`: consecutive runs of `paths`, split by size (a file
    goes to the part its middle byte falls in), so parts 0..count-1 in order are `paths`."""
    sizes = [os.path.getsize(p) for p in paths]
    total, start, mine = max(sum(sizes), 1), 0, []
    for path, size in zip(paths, sizes, strict=True):
        if min(count - 1, count * (2 * start + size) // (2 * total)) == index:
            mine.append(path)
        start += size
    if not mine:
        raise DataError(
            f"--shard {index}/{count} gets none of the {len(paths)} files (a file is not split "
            f"across shards): use at most {len(paths)} shards, or more, smaller files"
        )
    return mine


def shard_record(paths: list[str], index: int, count: int) -> dict:
    """meta.json's "shard" of part `index` of `count` of `paths`: the part, the count and the
    run's identity (a digest of every input's absolute path, in order), so that the trainer can
    tell a whole set of parts from some of them (`token_corpus.check_complete`)."""
    run = hashlib.blake2b(
        "\n".join(os.path.abspath(p) for p in paths).encode(), digest_size=8
    ).hexdigest()
    return {"index": index, "count": count, "run": run}


def _check_workers(workers: int | None) -> int:
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DataError(f"--workers {workers!r} is not an integer >= 1: pass e.g. --workers 8")
    return workers


def _write_npy(raw_path: str, npy_path: str, count: int) -> None:
    """`npy_path`: the .npy of the `count` int64 in `raw_path`, copied a block at a time."""
    header = {"descr": np.dtype("<i8").str, "fortran_order": False, "shape": (count,)}
    with open(raw_path, "rb") as src, open(npy_path, "wb") as dst:
        np.lib.format.write_array_header_1_0(dst, header)
        shutil.copyfileobj(src, dst, CHUNK_BYTES)


def _encode_into(paths, out_dir, spec, workers, progress, chunk_bytes) -> dict:
    """Writes the tmp token and raw offset files; returns their counts, max id and digest."""
    tok_tmp, _, raw_tmp, _ = (os.path.join(out_dir, n) for n in _tmp_names())
    digest = hashlib.blake2b(digest_size=16)  # the content's identity (tokens.fingerprint)
    n_tokens, n_docs, max_id = 0, 0, -1
    with open(tok_tmp, "wb") as tokens_out, open(raw_tmp, "wb") as offsets_out:
        offsets_out.write(np.zeros(1, np.int64).tobytes())
        todo = tasks(paths, text_field=spec.text_field, size=chunk_bytes)
        for enc, task in encode_ordered(todo, spec, workers):
            tokens_out.write(enc.ids)  # contiguous: written and hashed without a copy
            digest.update(enc.ids)
            offsets_out.write((enc.doc_ends + n_tokens).astype("<i8"))
            n_tokens += enc.ids.size
            n_docs += enc.doc_ends.size
            max_id = max(max_id, enc.max_id)
            if progress is not None:
                progress.update(task.disk_bytes, enc.doc_ends.size, enc.ids.size)
    return {"num_tokens": n_tokens, "num_documents": n_docs, "max_id": max_id, "digest": digest}


def _commit(out_dir: str, meta: dict) -> None:
    """Moves the finished tmp files into place: meta.json goes first and comes back last."""
    tok_tmp, npy_tmp, raw_tmp, meta_tmp = (os.path.join(out_dir, n) for n in _tmp_names())
    _write_npy(raw_tmp, npy_tmp, meta["num_documents"] + 1)
    os.remove(raw_tmp)
    with open(meta_tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    meta_path = os.path.join(out_dir, META_FILE)
    if os.path.exists(meta_path):
        os.remove(meta_path)
    os.replace(tok_tmp, os.path.join(out_dir, TOKENS_FILE))
    os.replace(npy_tmp, os.path.join(out_dir, OFFSETS_FILE))
    os.replace(meta_tmp, meta_path)


def prepare_data(
    text_files: list[str],
    out_dir: str,
    tokenizer: str = "bytes",
    *,
    binary_ok: bool = False,
    text_field: str = "text",
    workers: int | None = None,
    progress: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    shard: tuple[int, int] | None = None,
) -> dict:
    """Tokenize corpus files into ``out_dir/{tokens.bin, offsets.npy, meta.json}``.

    A ``.jsonl`` file (also ``.jsonl.gz``, ``.jsonl.zst``) contributes one document per line,
    a ``.parquet`` file one per row: the ``text_field`` of each; any other file (also ``.gz``,
    ``.zst``) is one document. Every document is followed by the tokenizer's end-of-text id.
    ``tokenizer`` is "bytes" (UTF-8 bytes 0..255, eos 256, vocab 257) or the path of a
    HuggingFace ``tokenizer.json`` (needs the ``tokenizers`` package). Tokens are stored as
    uint16 when the vocabulary fits, else uint32. Empty documents are skipped. ``workers``
    processes encode (default: the cores; the output does not depend on it); ``progress``
    reports to stderr; ``chunk_bytes`` is the unit of work (`corpus_read.CHUNK_BYTES`);
    ``shard`` (I, N) prepares only the I-th of N parts of the files (`shard_files`).
    Unless ``binary_ok``, an archive named as text (by its magic bytes) and a document, or a
    piece of a text file, more than ``sniff.MAX_CONTROL_FRACTION`` NUL/control characters are
    refused (DataError naming the file). On any error nothing is kept in ``out_dir``. Returns
    the metadata written.
    """
    if not text_files:
        raise DataError("no text files given: pass one or more text files to prepare")
    workers = _check_workers(workers)
    tok = load_tokenizer(tokenizer)
    for p in text_files:
        check_input(p, binary_ok=binary_ok, text_field=text_field)
    part = None if shard is None else shard_record(list(text_files), *shard)
    if shard is not None:
        text_files = shard_files(list(text_files), *shard)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"output directory {out_dir} cannot be created ({e.strerror}): choose a writable --out"
        ) from None
    spec = EncodeSpec(tokenizer, np.dtype(dtype).name, binary_ok, text_field)
    bar = Progress(sum(map(os.path.getsize, text_files)), sys.stderr) if progress else None
    try:
        counts = _encode_into(text_files, out_dir, spec, workers, bar, chunk_bytes)
        if counts["num_documents"] == 0:
            raise DataError(
                f"the corpus {list(text_files)} is empty (no non-empty document): pass text "
                f"files with content"
            )
        meta = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "vocab_size": int(tok.vocab_size),
            "eos_id": int(tok.eos_id),
            "pad_id": int(tok.eos_id),
            "max_token_id": counts["max_id"],
            "tokens_blake2b": counts["digest"].hexdigest(),
            "num_tokens": counts["num_tokens"],
            "num_documents": counts["num_documents"],
            "tokens_file": TOKENS_FILE,
            "offsets_file": OFFSETS_FILE,
            "tokenizer": tok.name,
            "sources": [os.path.abspath(p) for p in text_files],
            **({} if part is None else {"shard": part}),
        }
        _commit(out_dir, meta)
    except OSError as e:
        raise DataError(
            f"cannot write into {out_dir} ({e.strerror}): choose a writable --out"
        ) from None
    finally:  # a bad document, Ctrl-C, a full disk: no temporary file is left
        if bar is not None:
            bar.close()
        for name in _tmp_names():
            _remove(os.path.join(out_dir, name))
    return meta


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
