"""A config file on disk: its TOML, laid over the file its `extends` names.

    raw = read_config_file(Path("configs/my-run.toml"))   # {"model": {...}, ...}

A config file may start with a top-level `extends = "fuji-tiny.toml"` (a path relative to the
file): its tables' keys override the base file's keys of the same table, and the base may
extend another file in turn (a cycle is refused). Which sections a config must have, and what
their keys mean, is `trn_accum.config.load`'s business; every problem here raises
`ConfigError` with one line naming the file.
"""

from __future__ import annotations

import codecs
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trn_accum.errors import UserError

EXTENDS = "extends"  # the top-level key naming the config file a config builds on


class ConfigError(UserError):
    """A bad configuration: one line naming the key, the value and what is allowed."""


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML of `path` with its `extends` chain applied (the key itself removed)."""
    return _read_with_bases(Path(path), ())


def _read_with_bases(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The TOML of `path` laid over the file its top-level `extends` names (relative to
    `path`, recursively): a table's keys override the base's keys of the same table."""
    raw = _read_toml(path)
    base_name = raw.pop(EXTENDS, None)
    if base_name is None:
        return raw
    if not isinstance(base_name, str) or not base_name:
        raise ConfigError(
            f"config file {str(path)!r}: {EXTENDS} = {base_name!r} must be a config file path "
            f'(relative to the file), e.g. extends = "fuji-tiny.toml"'
        )
    base = (path.parent / base_name).resolve()
    chain = (*seen, path.resolve())
    if base in chain:
        raise ConfigError(
            f"config file {str(path)!r}: {EXTENDS} = {base_name!r} makes a cycle "
            f"({' -> '.join(p.name for p in (*chain, base))}): end the chain at a file without "
            f"{EXTENDS}"
        )
    if not base.is_file():
        raise ConfigError(
            f"config file {str(path)!r}: {EXTENDS} = {base_name!r} names {str(base)!r}, which "
            f"does not exist (the path is relative to the file that extends it)"
        )
    merged = _read_with_bases(base, chain)
    for name, value in raw.items():
        if isinstance(value, Mapping) and isinstance(merged.get(name), Mapping):
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = value
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    """The TOML of `path`. A leading UTF-8 byte order mark (some Windows editors write one) is
    skipped: tomllib would refuse it as an invalid statement at line 1, column 1."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return tomllib.loads(data[bom:].decode("utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {bom + e.start}): pass a TOML "
            f"config file such as configs/fuji-tiny.toml"
        ) from None
