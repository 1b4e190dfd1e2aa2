"""The corpus files `prepare-data` reads, streamed: plain text, JSONL (also gzip or zstd
compressed) and Parquet, cut into chunks of about `CHUNK_BYTES` that the encoders tokenize.

    check_input(path, binary_ok=False, text_field="text")   # a one-line DataError, or None
    for task in tasks(paths, text_field="text"):             # Task(chunks, disk_bytes)
        ...

The format comes from the file name: `.parquet`; `.jsonl` (one document per line, its
`text_field`), optionally `.gz` (gzip) or `.zst`/`.zstd` (zstd, needs `zstandard`); anything
else is plain text (optionally `.gz`/`.zst`), one document per file. Parquet needs `pyarrow`;
its text column may be any Arrow string type (string, large_string, string_view, or a
dictionary of those).

A compressed file is read to its true end: one that ends inside a gzip member or a zstd frame
(a cut download), or a 0-byte one (no stream at all), is an error naming the file, whatever
its content would be.

Memory stays bounded whatever the file size: text and JSONL are read `CHUNK_BYTES` at a time
and cut at a line boundary (a JSONL line is never split, so one line is the only unbounded
piece), Parquet `PARQUET_ROWS` rows at a time. A text file longer than one piece is encoded
piece by piece; the cut falls after a line break with a non-space character on both sides,
where byte-level BPE pre-tokenizers (GPT-2, Llama 3) split anyway, so its tokens are those of
the whole file encoded at once (a tokenizer that adds a prefix space to each call may differ
at the cuts). A line longer than a piece is cut at a UTF-8 character boundary. The encoders
check each text piece, not the whole file, for NUL and control characters.
"""

from __future__ import annotations

import gzip
import importlib
import io
import os
import zlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from trn_accum.data.sniff import HEAD_BYTES, archive_kind
from trn_accum.data.tokens import DataError

#: bytes of text or JSONL per chunk, and per encoder task (a task joins the chunks of small files)
CHUNK_BYTES = 1 << 18
#: Parquet rows per chunk
PARQUET_ROWS = 1024
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_WHITESPACE = b" \t\n\r\x0b\x0c"
_ZSTD_MAX_WINDOW = 1 << 31  # files written with `zstd --long=31`
#: compressed bytes fed to zstd at a time (bounds the output of one call)
_ZSTD_FEED = 1 << 13


class Chunk(NamedTuple):
    """A piece of one file. kind: "text" (payload: UTF-8 bytes; first: its byte offset in the
    decompressed file; last: it ends the file's document), "jsonl" (payload: whole lines;
    first: the line number of its first line) or "parquet" (payload: a list of str | None;
    first: the 1-based row number of its first row)."""

    kind: str
    path: str
    first: int
    payload: bytes | list
    last: bool


class Task(NamedTuple):
    """The chunks one encoder call tokenizes, and the bytes of input on disk they account for."""

    chunks: tuple[Chunk, ...]
    disk_bytes: int


def input_format(path: str) -> tuple[str, str | None]:
    """("text" | "jsonl" | "parquet", None | "gzip" | "zstd") from the file name."""
    stem, ext = os.path.splitext(path.lower())
    compression = _COMPRESSION.get(ext)
    if compression is None:
        stem = path.lower()
    if stem.endswith(".parquet"):
        if compression is not None:
            raise DataError(
                f"{path} is a compressed Parquet file: Parquet compresses its own pages; "
                f"decompress the file and pass the .parquet"
            )
        return "parquet", None
    return ("jsonl" if stem.endswith(".jsonl") else "text"), compression


def _need(module: str, extra_for: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise DataError(
            f"{extra_for} needs the `{top}` package, which is not installed: "
            f"`pip install {top}` (or `pip install 'trn_accum[data]'`)"
        ) from None


def check_input(path: str, *, binary_ok: bool = False, text_field: str = "text") -> None:
    """A one-line DataError if `path` cannot be read as the corpus file its name says: missing,
    a directory, an archive named as text (unless `binary_ok`), a missing optional package, or
    a Parquet file without a string column `text_field`."""
    if os.path.isdir(path):
        raise DataError(
            f"text file {path} is a directory: pass the text files in it (e.g. {path}/*.txt)"
        )
    if not os.path.isfile(path):
        raise DataError(f"text file {path} does not exist: pass existing text files")
    kind, compression = input_format(path)
    if compression == "zstd":
        _need("zstandard", f"the zstd file {path}")
    if kind == "parquet":
        _parquet_file(path, text_field)
    elif compression is None and not binary_ok:
        _refuse_archive(path)


def _refuse_archive(path: str) -> None:
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


def _parquet_file(path: str, text_field: str):
    pq = _need("pyarrow.parquet", f"the Parquet file {path}")
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path} cannot be read as Parquet ({str(e).splitlines()[0][:120]}): pass a "
            f"Parquet file, or name the file after its format (.jsonl, .txt)"
        ) from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path} has no column {text_field!r} (its columns: {schema.names[:12]}): pass "
            f"--text-field with the column that holds the text"
        )
    column_type = schema.field(text_field).type
    if not _is_text(pa, column_type):
        raise DataError(
            f"{path} column {text_field!r} is {column_type}, not a string: pass --text-field "
            f"with the column that holds the text"
        )
    return pf


def _is_text(pa, column_type) -> bool:
    """Whether an Arrow type holds strings: string, large_string, string_view, or a
    dictionary whose values are one of those."""
    if pa.types.is_dictionary(column_type):
        column_type = column_type.value_type
    is_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    return (
        pa.types.is_string(column_type)
        or pa.types.is_large_string(column_type)
        or is_view(column_type)
    )


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of zstd frames back to back; EOFError when the file ends inside
    a frame (`zstandard`'s stream reader ends quietly there)."""

    def __init__(self, raw, zstd):
        self._raw, self._zstd, self._dec, self._out = raw, zstd, None, b""

    def readable(self) -> bool:
        return True

    def _frame(self):
        return self._zstd.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW).decompressobj()

    def readinto(self, b) -> int:
        while not self._out:
            data = self._raw.read(_ZSTD_FEED)
            if not data:
                if self._dec is None:
                    raise EOFError("0 bytes: no zstd frame")
                if not self._dec.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            out = []
            while data:
                if self._dec is None or self._dec.eof:
                    self._dec = self._frame()
                out.append(self._dec.decompress(data))
                data = self._dec.unused_data if self._dec.eof else b""
            self._out = b"".join(out)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


def _open(path: str, compression: str | None) -> tuple[io.BufferedIOBase, io.BufferedIOBase]:
    """(the decompressed byte stream, the file on disk) of `path`."""
    raw = open(path, "rb")
    if compression is not None and os.fstat(raw.fileno()).st_size == 0:
        raw.close()
        raise DataError(
            f"{path} is 0 bytes, not a {compression} stream (a cut or failed download; an "
            f"empty corpus file compresses to more than 0 bytes): re-download it, or leave it out"
        )
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw), raw
    if compression == "zstd":
        zstd = _need("zstandard", f"the zstd file {path}")
        return io.BufferedReader(_ZstdFrames(raw, zstd), CHUNK_BYTES), raw
    return raw, raw


def _clean_break(buf: bytes, pos: int) -> bool:
    """Whether the line break `buf[pos]` has a non-space byte on both sides (a CR before it
    is part of it)."""
    before = pos - 2 if buf[pos - 1] == 0x0D and pos >= 2 else pos - 1
    return buf[before] not in _WHITESPACE and buf[pos + 1] not in _WHITESPACE


def _text_cut(buf: bytes) -> int:
    """Where to end a text piece in `buf`: after a line break with non-space bytes on both
    sides, else after the last line break, else at the last UTF-8 character start (not
    after a CR)."""
    pos = buf.rfind(b"\n", 0, len(buf) - 1)
    while pos > 0 and not _clean_break(buf, pos):
        pos = buf.rfind(b"\n", 0, pos)
    if pos <= 0:
        pos = buf.rfind(b"\n")
    if pos >= 0:
        return pos + 1
    cut = len(buf) - 1
    while cut > 0 and (buf[cut] & 0xC0 == 0x80 or buf[cut - 1] == 0x0D):
        cut -= 1
    return cut or len(buf)


def _pieces(stream, disk, size: int, text: bool) -> Iterator[tuple[int, bytes, int]]:
    """(offset in the stream, bytes, disk bytes read since the last piece). A text piece ends
    where `_text_cut` says in the next `size` bytes, so where the input is cut depends on its
    content only; a JSONL piece holds the whole lines that start in the next `size` bytes."""
    buf, offset, disk_seen, eof = bytearray(), 0, 0, False
    while True:
        while not eof and len(buf) < size:
            data = stream.read(size)
            eof = not data
            buf += data
        if eof and len(buf) <= size:
            if buf:
                yield offset, bytes(buf), disk.tell() - disk_seen
            return
        window = bytes(buf[:size])
        cut = _text_cut(window) if text else window.rfind(b"\n") + 1
        if cut == 0:  # a JSONL line longer than `size`
            cut = buf.find(b"\n", size) + 1 or (len(buf) if eof else 0)
            if cut == 0:
                data = stream.read(size)
                eof = not data
                buf += data
                continue
        where = disk.tell()
        yield offset, bytes(buf[:cut]), where - disk_seen
        del buf[:cut]
        disk_seen, offset = where, offset + cut


def _stream_chunks(path: str, kind: str, compression: str | None, size: int):
    broken = (OSError, EOFError, zlib.error)
    if compression == "zstd":
        broken += (_need("zstandard", f"the zstd file {path}").ZstdError,)
    stream, disk = _open(path, compression)
    with disk, stream:
        try:
            if kind == "text":
                pieces = _pieces(stream, disk, size, text=True)
                previous = next(pieces, (0, b"", 0))
                for piece in pieces:  # one piece ahead: the last one ends the document
                    yield Chunk("text", path, previous[0], previous[1], False), previous[2]
                    previous = piece
                yield Chunk("text", path, previous[0], previous[1], True), previous[2]
                return
            line = 1
            for _, piece, disk_bytes in _pieces(stream, disk, size, text=False):
                yield Chunk("jsonl", path, line, piece, True), disk_bytes
                line += piece.count(b"\n")
        except broken as e:
            raise _corrupt(path, compression, disk, e) from None


def _corrupt(path: str, compression: str | None, disk, e: Exception) -> DataError:
    what = f"a valid {compression} stream" if compression else "readable"
    if isinstance(e, EOFError):
        return DataError(
            f"{path} is not {what}: the file ends inside it, at byte {disk.tell()} ({e}); it "
            f"was cut short (an interrupted download or copy?): re-download or recompress it"
        )
    return DataError(
        f"{path} is not {what} near byte {disk.tell()} of the file ({e}): re-download or "
        f"recompress it"
    )


def _parquet_chunks(path: str, text_field: str, rows: int):
    pf = _parquet_file(path, text_field)
    size, total = os.path.getsize(path), max(pf.metadata.num_rows, 1)
    import pyarrow as pa

    done, batches = 0, pf.iter_batches(batch_size=rows, columns=[text_field])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise DataError(
                f"{path} is not readable Parquet after row {done} "
                f"({str(e).splitlines()[0][:120]}): re-download or rewrite it"
            ) from None
        if batch is None:
            return
        values = batch.column(0).to_pylist()
        seen = size * (done + len(values)) // total - size * done // total
        yield Chunk("parquet", path, done + 1, values, True), seen
        done += len(values)


def chunks(path: str, *, text_field: str = "text", size: int = CHUNK_BYTES):
    """(Chunk, disk bytes it accounts for) of one file, in file order."""
    kind, compression = input_format(path)
    if kind == "parquet":
        return _parquet_chunks(path, text_field, PARQUET_ROWS)
    return _stream_chunks(path, kind, compression, size)


def _chunk_bytes(chunk: Chunk) -> int:
    if isinstance(chunk.payload, bytes):
        return len(chunk.payload)
    return sum(len(v) for v in chunk.payload if v)


def tasks(
    paths: Iterable[str], *, text_field: str = "text", size: int = CHUNK_BYTES, on_empty=None
) -> Iterator[Task]:
    """The chunks of `paths`, in order, joined into tasks of at least `size` bytes (the last one
    may be smaller). How the input is cut depends on the input and `size` only, so the output
    is the same whatever the number of encoders. `on_empty(path)` is called for each file
    without content (no byte of text or JSONL once decompressed, no Parquet row)."""
    group, group_bytes, disk_bytes = [], 0, 0
    for path in paths:
        content = 0
        for chunk, seen in chunks(path, text_field=text_field, size=size):
            group.append(chunk)
            group_bytes += _chunk_bytes(chunk)
            content += _chunk_bytes(chunk) or int(chunk.kind == "parquet" and len(chunk.payload))
            disk_bytes += seen
            if group_bytes >= size:
                yield Task(tuple(group), disk_bytes)
                group, group_bytes, disk_bytes = [], 0, 0
        if content == 0 and on_empty is not None:
            on_empty(path)
    if group:
        yield Task(tuple(group), disk_bytes)
