"""Tokenize `corpus_read` tasks, in this process or across worker processes, in input order.

    spec = EncodeSpec("tokenizer.json", "uint16", binary_ok=False, text_field="text")
    for encoded, task in encode_ordered(tasks, spec, workers=8):
        encoded.ids        # the task's token ids (dtype spec.dtype), an eos after each document
        encoded.doc_ends   # int64, the end of each document completed in this task, in ids

Each worker process loads the tokenizer once and runs `tokenizers`' `encode_batch` over a
task's documents; results come back in task order whatever the number of workers, so the
output is the same bytes at 1 or N workers. At most `2 * workers` tasks are in flight
(bounded memory). The workers are forked (no re-import of this package and JAX per worker),
ignore SIGINT (the parent handles Ctrl-C and stops them), and run `tokenizers` single-threaded
(TOKENIZERS_PARALLELISM=false unless set): one process per core; on Linux they die with the
parent, even when it is killed. With one worker, or a single task, the tasks are encoded in
this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np

from trn_accum.data.corpus_read import Chunk, Task
from trn_accum.data.sniff import MAX_CONTROL_FRACTION, control_fraction
from trn_accum.data.tokens import BYTES_EOS_ID, BYTES_VOCAB_SIZE, DataError

_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class BytesTokenizer:
    """UTF-8 bytes as ids 0..255, eos 256."""

    name = digest = "bytes"
    vocab_size = BYTES_VOCAB_SIZE
    eos_id = BYTES_EOS_ID

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A HuggingFace tokenizer.json (the `tokenizers` package); eos: its end-of-text token."""

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
        with open(path, "rb") as f:  # the tokenizer's identity: what its file holds
            self.digest = "blake2b:" + hashlib.file_digest(f, _blake2b_16).hexdigest()
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20): the same ids, without the character offsets
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]


def _blake2b_16():
    return hashlib.blake2b(digest_size=16)


def load_tokenizer(spec: str) -> BytesTokenizer | HFTokenizer:
    """'bytes' or the path of a tokenizer.json."""
    return BytesTokenizer() if spec == "bytes" else HFTokenizer(spec)


class EncodeSpec(NamedTuple):
    tokenizer: str
    dtype: str
    binary_ok: bool = False
    text_field: str = "text"


class Encoded(NamedTuple):
    ids: np.ndarray  # [tokens] spec.dtype
    doc_ends: np.ndarray  # [documents completed here] int64, positions in ids (exclusive)
    max_id: int  # -1 when ids is empty


_state: dict = {}
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _refuse_binary(where: str, text: str) -> None:
    share = control_fraction(text)
    if share > MAX_CONTROL_FRACTION:
        raise DataError(
            f"text file {where} is {share:.1%} NUL or control characters (more than "
            f"{MAX_CONTROL_FRACTION:.0%}): it looks binary, not text; pass text files (or "
            f"--binary-ok to tokenize it as it is)"
        )


def _text_piece(chunk: Chunk) -> str:
    try:
        text = chunk.payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"text file {chunk.path} is not UTF-8 (byte {chunk.first + e.start}): convert it "
            f"to UTF-8"
        ) from None
    if "\r" in text:  # universal newlines, as text-mode reading does
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _field(where: str, record, field: str) -> str:
    if not isinstance(record, dict) or field not in record:
        found = list(record)[:12] if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where} has no field {field!r} (found: {found}): pass --text-field with the "
            f"field that holds the text, or fix the record"
        )
    value = record[field]
    if not isinstance(value, str):
        raise DataError(
            f"{where} field {field!r} is {type(value).__name__} {str(value)[:40]!r}, not a "
            f"string: fix the record or pass --text-field with the field that holds the text"
        )
    return value


def _refuse_surrogate(where: str, text: str) -> None:
    """A JSON string may escape half of a UTF-16 pair alone ("\\ud83d"): not a character,
    so not text any tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            f"{where} holds a lone surrogate \\u{ord(text[e.start]):04x} at character "
            f"{e.start} (half of a UTF-16 pair, not a character): fix the record (e.g. "
            f"replace it with \\ufffd)"
        ) from None


def _jsonl_records(chunk: Chunk, field: str) -> Iterator[tuple[str, str]]:
    for i, line in enumerate(chunk.payload.split(b"\n")):
        if not line.strip():
            continue
        where = f"{chunk.path}:{chunk.first + i}"
        try:
            record = json.loads(line)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            reason = getattr(e, "msg", None) or "not UTF-8"
            raise DataError(
                f"{where} is not a JSON object ({reason}): fix the line or pass plain .txt files"
            ) from None
        text = _field(where, record, field)
        if b"\\u" in line:  # only an escape can make a surrogate
            _refuse_surrogate(where, text)
        yield where, text


def _documents(chunk: Chunk, spec: EncodeSpec) -> Iterator[tuple[str, str, bool]]:
    """(where, text, ends a document) of one chunk."""
    if chunk.kind == "text":
        yield chunk.path, _text_piece(chunk), chunk.last
    elif chunk.kind == "jsonl":
        for where, text in _jsonl_records(chunk, spec.text_field):
            yield where, text, True
    else:
        for i, value in enumerate(chunk.payload):
            where = f"{chunk.path}:row {chunk.first + i}"
            yield where, _field(where, {spec.text_field: value}, spec.text_field), True


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this worker when the process that started it dies (a prepare-data killed
    with SIGKILL would otherwise leave its workers waiting forever)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a killed parent's workers linger
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _init(spec: EncodeSpec, parent: int | None) -> None:
    if parent is not None:  # a worker process
        _die_with_parent(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _state["tok"] = load_tokenizer(spec.tokenizer)
    _state["spec"] = spec


def encode_task(task: Task) -> Encoded:
    """The token ids of one task's documents (empty ones skipped), an eos after each."""
    tok, spec = _state["tok"], _state["spec"]
    texts, ends = [], []
    for chunk in task.chunks:
        for where, text, end in _documents(chunk, spec):
            if not text:
                continue
            if not spec.binary_ok:
                _refuse_binary(where, text)
            texts.append(text)
            ends.append(end)
    eos = np.asarray([tok.eos_id], dtype=spec.dtype)
    parts, doc_ends, n = [], [], 0
    for ids, end in zip(tok.encode_batch(texts), ends, strict=True):
        parts.append(np.asarray(ids, dtype=spec.dtype))
        n += len(ids)
        if end:
            parts.append(eos)
            n += 1
            doc_ends.append(n)
    ids = np.concatenate(parts) if parts else np.zeros(0, spec.dtype)
    return Encoded(ids, np.asarray(doc_ends, np.int64), int(ids.max()) if ids.size else -1)


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: seconds between two `check` calls while waiting for a worker
POLL_S = 0.1


def _nothing() -> None:
    return None


def _result(future, check: Callable[[], None]) -> Encoded:
    while True:
        try:
            return future.result(timeout=POLL_S)
        except TimeoutError:
            check()


def encode_ordered(
    tasks: Iterable[Task], spec: EncodeSpec, workers: int, check: Callable[[], None] = _nothing
) -> Iterator[tuple[Encoded, Task]]:
    """(Encoded, its Task) for each task, in order. One worker, or a single task: in this
    process; else at most `workers` forked processes, no more than there are tasks (the first
    `workers` tasks are read before any starts), at most 2 * workers tasks in flight.

    On an error (or Ctrl-C, or the caller closing this generator) the tasks not yet started
    are cancelled and the workers finish the one they hold and exit: a worker is never killed
    while it writes its result, which would leave the result pipe torn and the pool's
    shutdown waiting on it for good. `check` is called every `POLL_S` seconds while it waits
    for a worker (it may raise, e.g. the caller's KeyboardInterrupt for a SIGINT it noted)."""
    tasks = iter(tasks)
    head = list(itertools.islice(tasks, max(workers, 2)))
    workers = min(workers, len(head))
    tasks = itertools.chain(head, tasks)
    if workers <= 1:
        _init(spec, None)
        try:
            for task in tasks:
                yield encode_task(task), task
        finally:
            _state.clear()  # the tokenizer is not kept past the run
        return
    pool = ProcessPoolExecutor(
        workers,
        multiprocessing.get_context("fork"),
        initializer=_init,
        initargs=(spec, os.getpid()),
    )
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append((_submit(pool, task, workers), task))
            if len(pending) >= 2 * workers:
                future, done = pending.popleft()
                yield _result(future, check), done
        while pending:
            future, done = pending.popleft()
            yield _result(future, check), done
    except BrokenProcessPool:
        raise DataError(
            f"a prepare-data worker process died (killed, or out of memory?) with {workers} "
            f"workers: run again, with a smaller --workers if memory is short"
        ) from None
    finally:
        for future, _ in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _submit(pool: ProcessPoolExecutor, task: Task, workers: int):
    try:  # the first submit forks the workers
        return pool.submit(encode_task, task)
    except OSError as e:
        raise DataError(
            f"cannot start {workers} prepare-data worker processes ({e.strerror or e}): pass a "
            f"smaller --workers"
        ) from None
