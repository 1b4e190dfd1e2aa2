"""prepare-data's inputs are read to their true end and named when they cannot count: a cut
.zst or .gz is an error naming the file (not a JSON record), a 0-byte compressed file too; an
input without content is one warning line; a file named twice is refused; a lone surrogate
in a JSON string is one line naming the record; every Arrow string type of a Parquet text
column is read."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trn_accum import cli
from trn_accum.data.prepare import prepare_data
from trn_accum.data.tokens import read_meta

LINES = [
    json.dumps({"text": f"document {i}: " + "words and more words " * (i % 7)}) for i in range(400)
]
JSONL = "".join(line + "\n" for line in LINES).encode()
TEXT = b"".join(b"a line of plain text, number %d\n" % i for i in range(4000))


def _tokens(out) -> bytes:
    return open(read_meta(str(out))["tokens_path"], "rb").read()


def _one_line_error(capsys, *args) -> str:
    assert cli.main(["prepare-data", *map(str, args), "--workers", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("trn-accum: error: "), err
    return err[0]


@pytest.mark.parametrize("name", ["c.txt.zst", "c.jsonl.zst", "c.jsonl.gz", "c.txt.gz"])
def test_a_cut_compressed_file_is_an_error_naming_it(tmp_path, capsys, name):
    data = JSONL if ".jsonl" in name else TEXT
    compress = gzip.compress if name.endswith(".gz") else zstandard.ZstdCompressor().compress
    whole = compress(data)
    cut = tmp_path / name
    cut.write_bytes(whole[: len(whole) * 6 // 10])  # a download cut at 60 %
    out = tmp_path / "tok"
    line = _one_line_error(capsys, cut, "--out", out)
    kind = "gzip" if name.endswith(".gz") else "zstd"
    assert f"{cut} is not a valid {kind} stream: the file ends inside it" in line, line
    assert "cut short" in line
    assert "is not a JSON object" not in line
    assert not (out / "meta.json").exists()
    (tmp_path / name).write_bytes(whole)  # the whole file reads as its plain twin
    plain = tmp_path / ("p.jsonl" if ".jsonl" in name else "p.txt")
    plain.write_bytes(data)
    prepare_data([str(tmp_path / name)], str(tmp_path / "a"), workers=1, chunk_bytes=4096)
    prepare_data([str(plain)], str(tmp_path / "b"), workers=1, chunk_bytes=4096)
    assert _tokens(tmp_path / "a") == _tokens(tmp_path / "b")


def test_zstd_frames_back_to_back_are_all_read(tmp_path):
    z = zstandard.ZstdCompressor()
    half = len(JSONL) // 2 + JSONL[len(JSONL) // 2 :].index(b"\n") + 1
    (tmp_path / "two.jsonl.zst").write_bytes(z.compress(JSONL[:half]) + z.compress(JSONL[half:]))
    (tmp_path / "p.jsonl").write_bytes(JSONL)
    prepare_data([str(tmp_path / "two.jsonl.zst")], str(tmp_path / "a"), workers=1)
    prepare_data([str(tmp_path / "p.jsonl")], str(tmp_path / "b"), workers=1)
    assert _tokens(tmp_path / "a") == _tokens(tmp_path / "b")
    assert read_meta(str(tmp_path / "a"))["num_documents"] == len(LINES)


def test_empty_and_duplicate_inputs_are_named(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_bytes(JSONL)
    for name in ("zero.jsonl.gz", "zero.txt.zst"):  # 0 bytes: no stream at all, a cut file
        (tmp_path / name).write_bytes(b"")
        line = _one_line_error(capsys, good, tmp_path / name, "--out", tmp_path / "o")
        assert f"{tmp_path / name} is 0 bytes, not a" in line, line
    # a valid stream of nothing, an empty file: one warning line each, and the rest is kept
    (tmp_path / "nothing.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "nothing.txt").write_bytes(b"")
    args = [good, tmp_path / "nothing.jsonl.gz", tmp_path / "nothing.txt"]
    assert cli.main(["prepare-data", *map(str, args), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"prepare-data: warning: input {tmp_path / 'nothing.jsonl.gz'} has no content: it adds "
        f"no document",
        f"prepare-data: warning: input {tmp_path / 'nothing.txt'} has no content: it adds no "
        f"document",
    ]
    assert read_meta(str(tmp_path / "o"))["num_documents"] == len(LINES)
    before = {n: (tmp_path / "o" / n).read_bytes() for n in os.listdir(tmp_path / "o")}
    again = os.path.join(str(tmp_path), ".", "good.jsonl")  # the same file by another name
    line = _one_line_error(capsys, good, tmp_path / "nothing.txt", again, "--out", tmp_path / "o")
    assert line == (
        f"trn-accum: error: input {again} is the file {good} named again (both are {good}): "
        f"its documents would be read twice; name each file once"
    )
    assert {n: (tmp_path / "o" / n).read_bytes() for n in os.listdir(tmp_path / "o")} == before


def test_a_lone_surrogate_is_one_line_naming_the_record(tmp_path, capsys):
    src = tmp_path / "s.jsonl"
    records = ["fine", "a pair \\ud83d\\ude00 is fine", "half \\ud83d of one"]
    src.write_text("".join('{"text": "' + r + '"}\n' for r in records))
    line = _one_line_error(capsys, src, "--out", tmp_path / "o")
    assert line == (
        f"trn-accum: error: {src}:3 holds a lone surrogate \\ud83d at character 5 (half of a "
        f"UTF-16 pair, not a character): fix the record (e.g. replace it with \\ufffd)"
    )
    src.write_text('{"text": "a pair \\ud83d\\ude00 is fine"}\n{"text": "\\\\ud83d as text"}\n')
    meta = prepare_data([str(src)], str(tmp_path / "o"), workers=1)
    assert meta["num_documents"] == 2


def test_every_arrow_string_type_is_a_text_column(tmp_path):
    texts = [f"row {i} " + "some words " * (i % 5) for i in range(50)]
    columns = {
        "string": pa.array(texts, pa.string()),
        "large_string": pa.array(texts, pa.large_string()),
        "dictionary": pa.array(texts, pa.string()).dictionary_encode(),
        "string_view": pa.array(texts, pa.string_view()),
    }
    ref = None
    for kind, column in columns.items():
        path = tmp_path / f"{kind}.parquet"
        pq.write_table(pa.table({"text": column}), path)
        assert pq.ParquetFile(path).schema_arrow.field("text").type == column.type, kind
        prepare_data([str(path)], str(tmp_path / kind), workers=1)
        tokens = np.fromfile(tmp_path / kind / "tokens.bin", np.uint16)
        ref = tokens if ref is None else ref
        assert np.array_equal(tokens, ref), kind
