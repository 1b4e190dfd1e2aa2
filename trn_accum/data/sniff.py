"""Whether a file handed to `prepare-data` is text: archives by their magic bytes, and text
heavy in NUL or control characters (a tar archive of text files is valid UTF-8, 16 % NUL).

    kind = archive_kind(head)          # "tar", "gzip", ... or None; head: the first 512 bytes
    share = control_fraction(text)     # NUL and C0/DEL control characters, except whitespace

The magic numbers are the formats' own: gzip 1f 8b (RFC 1952 section 2.3.1), zip "PK\\x03\\x04"
(PKWARE APPNOTE 4.3.7), bzip2 "BZh", xz fd "7zXZ" 00 (xz file format 2.1.1.1), zstd
28 b5 2f fd (RFC 8878 section 3.1.1), 7z "7z\\xbc\\xaf\\x27\\x1c", and POSIX tar's "ustar" at
offset 257 (POSIX.1-1988 ustar header; GNU tar writes "ustar  ").
"""

from __future__ import annotations

MAGIC: dict[bytes, str] = {
    b"\x1f\x8b": "gzip",
    b"PK\x03\x04": "zip",
    b"PK\x05\x06": "zip",  # an empty zip archive
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"7z\xbc\xaf\x27\x1c": "7z",
}
TAR_MAGIC_OFFSET = 257
TAR_MAGIC = b"ustar"
HEAD_BYTES = 512  # enough for every magic above

# a text may hold a few control characters (a form feed, an ANSI colour escape); more than
# this share of its characters is not text
MAX_CONTROL_FRACTION = 0.01
_WHITESPACE = {9, 10, 11, 12, 13}  # \t \n \v \f \r
_DROP_CONTROL = dict.fromkeys([c for c in range(32) if c not in _WHITESPACE] + [127])


def archive_kind(head: bytes) -> str | None:
    """The archive or compression format whose magic `head` (a file's first bytes) starts
    with, else None."""
    for magic, kind in MAGIC.items():
        if head.startswith(magic):
            return kind
    if head[TAR_MAGIC_OFFSET : TAR_MAGIC_OFFSET + len(TAR_MAGIC)] == TAR_MAGIC:
        return "tar"
    return None


def control_fraction(text: str) -> float:
    """The share of `text`'s characters that are NUL or other control characters (C0 and DEL,
    not tab, newline, vertical tab, form feed, carriage return); 0.0 for an empty text."""
    if not text:
        return 0.0
    return (len(text) - len(text.translate(_DROP_CONTROL))) / len(text)
