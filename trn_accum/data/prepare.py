"""`trn-accum prepare-data`: tokenize corpus files into the token directory `TokenDataset` reads.

    prepare_data(["a.txt", "b.jsonl.zst", "c.parquet"], "data/tok", tokenizer="bytes")

writes `tokens.bin` (uint16/uint32 ids), `offsets.npy` (document boundaries) and `meta.json`
(`trn_accum.data.tokens.read_meta` checks them on load). The input is streamed
(`corpus_read`) and tokenized across worker processes in input order (`corpus_encode`):
memory stays bounded whatever the corpus size, and the output is the same bytes at any
number of workers.

The output directory is one run's at a time (`out_dir.OutDir`: a lock naming its holder, only
files prepare-data writes, temporary names unique to the run, published by rename with
`meta.json` last), so a run stopped at any point (an error, a full disk, Ctrl-C, SIGKILL)
leaves the earlier output as it was, or no `meta.json`; never a mix. A rerun starts over
(`interrupted_files` names what a killed run left behind).

Inputs: a file named twice (the same real path) is refused, naming both arguments; an input
with no content (a 0-byte text or JSONL file, a compressed file that decompresses to nothing,
a Parquet file without rows) is named in one warning line and adds nothing; a compressed input
that ends before its stream does (a cut download, a 0-byte .gz/.zst) is an error naming it.

Ctrl-C: the first SIGINT stops the run with KeyboardInterrupt at its next safe point (between
two input files or two tasks, or within `corpus_encode.POLL_S` while it waits for a worker),
later ones change nothing while it cleans up, and one that comes while the finished files are
renamed into place lets the renames finish (the run then completes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable

import numpy as np

from trn_accum.data.corpus_encode import (
    EncodeSpec,
    default_workers,
    encode_ordered,
    load_tokenizer,
)
from trn_accum.data.corpus_read import CHUNK_BYTES, check_input, tasks
from trn_accum.data.out_dir import RAW_OFFSETS, OutDir, interrupted_files
from trn_accum.data.progress import Progress
from trn_accum.data.tokens import (
    FORMAT,
    META_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    DataError,
    sampled_digest,
)

__all__ = ["interrupted_files", "parse_shard", "prepare_data", "shard_files", "shard_record"]


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


def _check_duplicates(paths: list[str]) -> None:
    seen: dict[str, str] = {}
    for p in paths:
        key = os.path.realpath(p)
        if key in seen:
            raise DataError(
                f"input {p} is the file {seen[key]} named again (both are {key}): its "
                f"documents would be read twice; name each file once"
            )
        seen[key] = p


class _Interrupts:
    """SIGINT while a run is on: the handler only notes it; `check` raises KeyboardInterrupt
    at the run's safe points. A KeyboardInterrupt raised in the handler could land in a
    callback (a gc callback such as JAX's, an at-fork hook), where Python prints it and goes
    on; a second SIGINT would interrupt the clean-up. A no-op off the main thread."""

    def __init__(self):
        self.hit, self.defer, self._old = False, False, None

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def check(self) -> None:
        if self.hit and not self.defer:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        self.defer = True
        try:
            yield
        finally:
            self.defer = False

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _write_npy(raw_path: str, npy_path: str, count: int) -> None:
    """`npy_path`: the .npy of the `count` int64 in `raw_path`, copied a block at a time."""
    header = {"descr": np.dtype("<i8").str, "fortran_order": False, "shape": (count,)}
    with open(raw_path, "rb") as src, open(npy_path, "wb") as dst:
        np.lib.format.write_array_header_1_0(dst, header)
        shutil.copyfileobj(src, dst, CHUNK_BYTES)


def _encode_into(paths, out: OutDir, spec, workers, progress, chunk_bytes, note, stop) -> dict:
    """Writes the tmp token and raw offset files; returns their counts, max id and digest."""
    digest = hashlib.blake2b(digest_size=16)  # the content's identity (tokens.fingerprint)
    n_tokens, n_docs, max_id = 0, 0, -1

    def empty(path: str) -> None:
        note(f"prepare-data: warning: input {path} has no content: it adds no document")

    todo = tasks(paths, text_field=spec.text_field, size=chunk_bytes, on_empty=empty)
    with (
        open(out.temp(TOKENS_FILE), "wb") as tokens_out,
        open(out.temp(RAW_OFFSETS), "wb") as offsets_out,
        contextlib.closing(encode_ordered(todo, spec, workers, stop.check)) as encoded,
    ):
        offsets_out.write(np.zeros(1, np.int64).tobytes())
        for enc, task in encoded:
            stop.check()
            tokens_out.write(enc.ids)  # contiguous: written and hashed without a copy
            digest.update(enc.ids)
            offsets_out.write((enc.doc_ends + n_tokens).astype("<i8"))
            n_tokens += enc.ids.size
            n_docs += enc.doc_ends.size
            max_id = max(max_id, enc.max_id)
            if progress is not None:
                progress.update(task.disk_bytes, enc.doc_ends.size, enc.ids.size)
    return {"num_tokens": n_tokens, "num_documents": n_docs, "max_id": max_id, "digest": digest}


def _commit(out: OutDir, meta: dict, stop: _Interrupts) -> None:
    """Writes offsets.npy and meta.json (with the files' sampled digests, which the loader
    checks) under this run's temporary names, then publishes all three."""
    tokens, offsets, meta_tmp = (out.temp(n) for n in (TOKENS_FILE, OFFSETS_FILE, META_FILE))
    _write_npy(out.temp(RAW_OFFSETS), offsets, meta["num_documents"] + 1)
    os.remove(out.temp(RAW_OFFSETS))
    meta["sample_blake2b"] = {
        "tokens": sampled_digest(tokens).hex(),
        "offsets": sampled_digest(offsets).hex(),
    }
    with open(meta_tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    stop.check()
    with stop.deferred():
        out.publish({TOKENS_FILE: tokens, OFFSETS_FILE: offsets, META_FILE: meta_tmp})


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    note: Callable[[str], None] = _stderr,
) -> dict:
    """Tokenize corpus files into ``out_dir/{tokens.bin, offsets.npy, meta.json}``.

    A ``.jsonl`` file (also ``.jsonl.gz``, ``.jsonl.zst``) contributes one document per line,
    a ``.parquet`` file one per row: the ``text_field`` of each; any other file (also ``.gz``,
    ``.zst``) is one document. Every document is followed by the tokenizer's end-of-text id.
    ``tokenizer`` is "bytes" (UTF-8 bytes 0..255, eos 256, vocab 257) or the path of a
    HuggingFace ``tokenizer.json`` (needs the ``tokenizers`` package; its digest is recorded
    as ``tokenizer_digest``). Tokens are stored as uint16 when the vocabulary fits, else
    uint32. Empty documents are skipped. ``workers`` processes encode (default: the cores; at
    most one per task; the output does not depend on it); ``progress`` reports to stderr;
    ``chunk_bytes`` is the unit of work (`corpus_read.CHUNK_BYTES`); ``shard`` (I, N) prepares
    only the I-th of N parts of the files (`shard_files`); ``note`` gets the warning lines
    (an input without content, the temporary files of an interrupted run).
    Unless ``binary_ok``, an archive named as text (by its magic bytes) and a document, or a
    piece of a text file, more than ``sniff.MAX_CONTROL_FRACTION`` NUL/control characters are
    refused (DataError naming the file). On any error nothing in ``out_dir`` changes but this
    run's temporary files, which are removed. Returns the metadata written.
    """
    if not text_files:
        raise DataError("no text files given: pass one or more text files to prepare")
    workers = _check_workers(workers)
    tok = load_tokenizer(tokenizer)
    with _Interrupts() as stop:
        for p in text_files:
            check_input(p, binary_ok=binary_ok, text_field=text_field)
            stop.check()
        _check_duplicates(list(text_files))
        part = None if shard is None else shard_record(list(text_files), *shard)
        if shard is not None:
            text_files = shard_files(list(text_files), *shard)
        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
        spec = EncodeSpec(tokenizer, np.dtype(dtype).name, binary_ok, text_field)
        with OutDir(out_dir, list(text_files)) as out:
            if out.stale:
                note(
                    f"prepare-data: {out_dir} holds the temporary files of an interrupted run "
                    f"({', '.join(out.stale)}): starting over"
                )
            total = sum(map(os.path.getsize, text_files))
            bar = Progress(total, sys.stderr) if progress else None
            try:
                counts = _encode_into(text_files, out, spec, workers, bar, chunk_bytes, note, stop)
                if counts["num_documents"] == 0:
                    raise DataError(
                        f"the corpus {list(text_files)} is empty (no non-empty document): "
                        f"pass text files with content"
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
                    "tokenizer_digest": tok.digest,
                    "sources": [os.path.abspath(p) for p in text_files],
                    **({} if part is None else {"shard": part}),
                }
                _commit(out, meta, stop)
            except OSError as e:
                raise DataError(
                    f"cannot write into {out_dir} ({e.strerror}): free space or choose a "
                    f"writable --out (its earlier output is unchanged)"
                ) from None
            finally:
                if bar is not None:
                    bar.close()
    return meta
