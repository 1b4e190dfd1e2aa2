"""Issue 38, fault 5: `prepare-data` refuses archives (by their magic bytes) and text heavy in
NUL/control characters in one line naming the file, unless --binary-ok; nothing is kept."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import zipfile

import pytest

from trn_accum import cli
from trn_accum.data.sniff import archive_kind, control_fraction

TEXT = ("the quick brown fox jumps over the lazy dog.\n" * 50).encode()


def _tar(text: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    return buf.getvalue()


def _zip(text: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", text)
    return buf.getvalue()


ARCHIVES = {
    "tar": _tar(TEXT),  # valid UTF-8 throughout: only the magic (or the NULs) tell
    "gzip": gzip.compress(TEXT),
    "zip": _zip(TEXT),
    "bzip2": bz2.compress(TEXT),
    "xz": lzma.compress(TEXT),
    "zstd": bytes.fromhex("28b52ffd") + b"\x00" * 16,  # a zstd frame header (RFC 8878)
}


@pytest.mark.parametrize("kind", ARCHIVES)
def test_archive_kind_by_magic(kind):
    assert archive_kind(ARCHIVES[kind][:512]) == kind
    assert archive_kind(TEXT[:512]) is None


def test_control_fraction():
    assert control_fraction("") == 0.0
    assert control_fraction("tab\there\r\n\f") == 0.0
    assert control_fraction("ab\x00\x1b") == 0.5


def _prepare(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["prepare-data", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("kind", ARCHIVES)
def test_archive_is_refused_in_one_line(tmp_path, capsys, kind):
    src = tmp_path / "corpus.txt"
    src.write_bytes(ARCHIVES[kind])
    code, out, err = _prepare(capsys, src, "--out", tmp_path / "tok")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert str(src) in err and kind in err and "--binary-ok" in err, err
    assert not (tmp_path / "tok").exists() or not any((tmp_path / "tok").iterdir())


def test_nul_heavy_utf8_text_is_refused_and_binary_ok_accepts_it(tmp_path, capsys):
    src = tmp_path / "dump.txt"
    src.write_bytes(TEXT + b"\x00" * 200)  # valid UTF-8, no magic, 8 % NUL
    code, _, err = _prepare(capsys, src, "--out", tmp_path / "tok")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(src) in err and "NUL or control" in err and "--binary-ok" in err, err
    assert not (tmp_path / "tok" / "tokens.bin").exists()
    code, out, _ = _prepare(capsys, src, "--out", tmp_path / "tok", "--binary-ok")
    assert code == 0 and f"wrote {len(TEXT) + 201:,} tokens" in out, out


def test_text_with_a_few_control_characters_passes(tmp_path, capsys):
    src = tmp_path / "log.txt"
    src.write_bytes(TEXT + b"\x1b[31mred\x1b[0m\f\n")  # ANSI colours and a form feed: text
    code, out, err = _prepare(capsys, src, "--out", tmp_path / "tok")
    assert code == 0, err
