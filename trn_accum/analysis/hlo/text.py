"""Lexing of HLO text: array types, attribute lists, brackets, names (stdlib only).

The pieces `trn_accum.analysis.hlo.module` (module structure) and `trn_accum.analysis.collectives`
(replica groups) parse with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

__all__ = [
    "ArrayType",
    "match_close",
    "names_in",
    "operand_names",
    "parse_attrs",
    "parse_type",
    "split_top_level",
    "strip_braces",
    "tuple_arity",
    "unquote",
]

# Bytes per element; sub-byte types are rounded up per array in `ArrayType.nbytes`.
_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}
_F8 = re.compile(r"^f8e\w+$|^f4e\w+$|^f6e\w+$|^f8$")


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """One array in a result type: dtype ("f32", "bf16", "pred", "token", ...) and dims.

    Dynamic dims printed as `<=N` are taken at their bound N.
    """

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        bits = _DTYPE_BITS.get(self.dtype)
        if bits is None:
            bits = 8 if _F8.match(self.dtype) else 0
            if bits == 0 and self.dtype.startswith("f"):
                # Unknown float type: take the digits as the bit width (e.g. "f8e3m4").
                m = re.match(r"f(\d+)", self.dtype)
                bits = int(m.group(1)) if m else 0
        return (self.size * bits + 7) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_type(text: str) -> tuple[ArrayType, ...]:
    """Flattened leaves of an HLO type: `f32[4,8]{1,0}` or `(f32[4], (s32[], u32[]))`."""
    out = []
    # Drop comments such as /*index=5*/ and layouts (braces) before matching arrays.
    text = re.sub(r"/\*.*?\*/", "", text)
    text = strip_braces(text)
    for m in _ARRAY_RE.finditer(text):
        dims = []
        for d in m.group(2).split(","):
            d = d.strip()
            if not d:
                continue
            dims.append(int(d.lstrip("<=").strip()))
        out.append(ArrayType(m.group(1), tuple(dims)))
    return tuple(out)


def strip_braces(text: str) -> str:
    """`text` without anything inside {...} (layouts, attributes)."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def operand_names(text: str) -> list[str]:
    """Instruction names in an operand list (`%a, %b` or typed `f32[4] a, ...`)."""
    if "%" in text:
        return re.findall(r"%([^\s,(){}]+)", text)
    names = []
    for part in split_top_level(text):
        tok = part.strip().split(" ")[-1] if part.strip() else ""
        if tok and re.match(r"^[A-Za-z_][\w.\-]*$", tok):
            names.append(tok)
    return names


def parse_attrs(text: str) -> dict[str, str]:
    """`key=value, ...` attribute text -> {key: raw value}."""
    attrs: dict[str, str] = {}
    parts = split_top_level(text)
    last_key = None
    for part in parts:
        part = part.strip()
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip()
        if (
            eq
            and key == "device_ids"
            and last_key is not None
            and attrs[last_key].startswith("mesh[")
        ):
            # `replica_groups=mesh[...], device_ids=(...) {axes}` prints a top-level comma.
            attrs[last_key] += ", " + part
            continue
        if not eq:
            if last_key is not None:
                attrs[last_key] += ", " + part
            continue
        attrs[key] = value.strip()
        last_key = key
    return attrs


def tuple_arity(type_text: str) -> int:
    """Elements of a tuple type (1 for an array); `/*index=N*/` comments ignored."""
    t = re.sub(r"/\*.*?\*/", "", type_text).strip()
    return len(split_top_level(t[1:-1])) if t.startswith("(") else 1


def split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets and quotes."""
    out, buf, depth, quote = [], [], 0, None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(text):
                buf.append(text[i + 1])
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            buf.append(ch)
        elif ch in "([{":
            depth += 1
            buf.append(ch)
        elif ch in ")]}":
            depth -= 1
            buf.append(ch)
        elif ch == "," and depth == 0:
            out.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        i += 1
    if buf:
        out.append("".join(buf))
    return out


def match_close(text: str, open_idx: int) -> int:
    """Index of the bracket closing the one at `open_idx` (quotes respected)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth, quote = 0, None
    for i in range(open_idx, len(text)):
        ch = text[i]
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
            continue
        if ch in "\"'" and depth > 0:
            quote = ch
        elif ch in pairs:
            depth += 1
        elif ch in pairs.values():
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO text: {text[:200]!r}")


def names_in(value: str, *, bare_ok: bool) -> list[str]:
    """`%name` references in an attribute value (or, with `bare_ok`, bare identifiers)."""
    names = re.findall(r"%([^\s,(){}]+)", value)
    if names or not bare_ok:
        return names
    return [n for n in re.findall(r"[A-Za-z_][\w.\-]*", value)]


def unquote(value: str) -> str:
    """A JSON-quoted attribute value decoded; anything else stripped."""
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value)
    return value
