"""`TokenCorpus`: one prepared token directory, or a set of them (the shards `prepare-data
--shard I/N` writes), read as one token stream.

``data.path`` names a directory (or its meta.json), a glob (``"data/tok/shard-*"``: its
matches, the parts of one `--shard I/N` run in the order of their recorded index I, so
part-2 comes before part-10, other matches sorted by name) or a list of those (each in turn,
in the list's order). The shards' documents
follow one another in that order, each shard's own offsets shifted by the tokens before it, so
shards 0..N-1 of a corpus give exactly the tokens and document boundaries of one unsharded
prepare-data (a document never spans two shards: every one ends with its end-of-text id).
Every shard is checked as one directory is (`tokens.read_meta`); the shards must agree on what
makes their ids one vocabulary (`MUST_AGREE`, the digest of the tokenizer.json included: two
tokenizers of one vocabulary size and end-of-text id are still two vocabularies). Tokens stay
on disk, read with ``os.pread`` (`tokens.TokenFile`, one per shard); only the document offsets
(8 bytes a document) are held.

The identity of a set is a fingerprint over its shards' fingerprints in order, so adding,
dropping, reordering or re-preparing a shard is a data change on resume (`trn_accum.train.
drift`); a set of one directory has that directory's fingerprint.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from trn_accum.data.tokens import META_FILE, DataError, TokenFile, fingerprint, read_meta

#: sidecar fields every shard of one corpus must share: their ids are one vocabulary
MUST_AGREE = ("format", "dtype", "vocab_size", "eos_id", "pad_id", "tokenizer_digest")
_GLOB_CHARS = "*?["


def _expand(item: str) -> list[str]:
    """`item` itself, or when it is a glob that names no existing path, its sorted matches
    that can be prepared data (directories and meta.json files)."""
    if not isinstance(item, str) or not item:
        raise DataError(
            f"data.path entry {item!r} is not a directory name: give a directory written by "
            f"`trn-accum prepare-data`, a glob of them, or a list of those"
        )
    if os.path.exists(item) or not any(c in item for c in _GLOB_CHARS):
        return [item]
    found = [
        m for m in sorted(glob.glob(item)) if os.path.isdir(m) or os.path.basename(m) == META_FILE
    ]
    if not found:
        raise DataError(
            f"data.path glob {item!r} matches no directory: run `trn-accum prepare-data "
            f"--shard I/N` (or launch/slurm/prepare-data.sbatch) first, or fix the pattern"
        )
    return by_part(found)


def _part(path: str) -> tuple[str, int] | None:
    """(run, index) of a `--shard I/N` part's meta.json, else None (read_meta judges it later)."""
    meta_path = os.path.join(path, META_FILE) if os.path.isdir(path) else path
    try:
        with open(meta_path, encoding="utf-8") as f:
            part = json.load(f)["shard"]
        return str(part["run"]), int(part["index"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def by_part(paths: list[str]) -> list[str]:
    """`paths` (sorted by name) with the parts of each `--shard I/N` run in index order, the
    run's parts at the place of its first one; other paths stay where they are."""
    parts = [_part(p) for p in paths]
    first: dict[str, int] = {}
    keys = []
    for i, part in enumerate(parts):
        if part is None:
            keys.append((i, 0))
        else:
            keys.append((first.setdefault(part[0], i), part[1]))
    return [p for _, p in sorted(zip(keys, paths, strict=True), key=lambda kp: kp[0])]


def corpus_dirs(path: str | Sequence[str]) -> list[str]:
    """The prepared directories (or meta.json files) `path` names, in corpus order: a name, a
    glob's sorted matches, or a list of those expanded in turn. DataError for an empty list, a
    glob without a match, or a directory named twice."""
    items = [path] if isinstance(path, str) else list(path)
    if not items:
        raise DataError(
            "data.path is an empty list: name one or more directories written by "
            "`trn-accum prepare-data`"
        )
    dirs = [d for item in items for d in _expand(item)]
    seen: dict[str, str] = {}
    for d in dirs:
        key = os.path.realpath(d if os.path.isdir(d) else os.path.dirname(d))
        if key in seen:
            raise DataError(
                f"data.path names the token directory {key} twice ({seen[key]!r} and {d!r}): "
                f"its documents would be read twice; list each shard once"
            )
        seen[key] = d
    return dirs


def check_agree(metas: Sequence[dict[str, Any]], dirs: Sequence[str]) -> None:
    """DataError naming the first shard whose `MUST_AGREE` field differs from the first's."""
    first = metas[0]
    for d, meta in zip(dirs[1:], metas[1:], strict=True):
        for key in MUST_AGREE:
            mine, theirs = _field(meta, key), _field(first, key)
            if mine != theirs:
                raise DataError(
                    f"token data shard {d} has {key} = {mine!r} but {dirs[0]} has {theirs!r}: "
                    f"the shards of one corpus must share a tokenizer; re-run `trn-accum "
                    f"prepare-data` for {d} with the others' --tokenizer, or leave it out of "
                    f"data.path"
                )


def check_complete(metas: Sequence[dict[str, Any]], dirs: Sequence[str]) -> None:
    """DataError when the set holds some parts of a `prepare-data --shard I/N` run but not
    all N, or one part twice (each part's meta.json "shard": index, count, run): a glob that
    matched the parts finished so far would train on part of the corpus."""
    runs: dict[tuple[str, int], dict[int, str]] = {}
    for d, meta in zip(dirs, metas, strict=True):
        part = meta.get("shard")
        if part is None:
            continue
        try:
            key, index = (str(part["run"]), int(part["count"])), int(part["index"])
        except (TypeError, KeyError, ValueError):
            raise DataError(
                f"token data {d} has a malformed shard record {part!r}: re-run `trn-accum "
                f"prepare-data --shard I/N` for it"
            ) from None
        if index in runs.setdefault(key, {}):
            raise DataError(
                f"token data {d} and {runs[key][index]} are both part {index}/{key[1]} of one "
                f"prepare-data run: list each part once"
            )
        runs[key][index] = d
    for (_, count), parts in runs.items():
        if missing := sorted(set(range(count)) - set(parts)):
            have = ", ".join(f"{i}/{count}" for i in sorted(parts))
            raise DataError(
                f"data.path holds parts {have} of a `prepare-data --shard I/{count}` run but not "
                f"{', '.join(f'{i}/{count}' for i in missing)} (not finished, or left out): "
                f"wait for them or prepare them, then name the whole set (e.g. OUT/shard-*)"
            )


def _field(meta: dict[str, Any], key: str) -> Any:
    return meta.get(key, meta["eos_id"]) if key == "pad_id" else meta.get(key)


def merged_meta(metas: Sequence[dict[str, Any]], dirs: Sequence[str]) -> dict[str, Any]:
    """The sidecar of the whole set: one directory's own, or the shared `MUST_AGREE` fields,
    the largest id, the summed token and document counts and the shard directories."""
    if len(metas) == 1:
        return metas[0]
    out = {k: _field(metas[0], k) for k in MUST_AGREE if _field(metas[0], k) is not None}
    return {
        **out,
        "max_token_id": max(int(m.get("max_token_id", m["vocab_size"] - 1)) for m in metas),
        "num_tokens": sum(int(m["num_tokens"]) for m in metas),
        "num_documents": sum(int(m["num_documents"]) for m in metas),
        "shards": [os.path.abspath(d) for d in dirs],
    }


def load_offsets(meta: dict[str, Any]) -> np.ndarray:
    """int64 [num_documents + 1] document boundaries of one directory (`read_meta`'s output),
    read whole (no memory map to fault if the file changes); DataError unless they run from 0
    to num_tokens without decreasing."""
    path, n_tok, n_doc = meta["offsets_path"], int(meta["num_tokens"]), int(meta["num_documents"])
    try:
        offsets = np.asarray(np.load(path, allow_pickle=False), dtype=np.int64)
    except (OSError, ValueError) as e:
        raise DataError(
            f"offsets file {path} is not a readable .npy array ({type(e).__name__}): re-run "
            f"`trn-accum prepare-data`"
        ) from None
    if (
        offsets.ndim != 1
        or offsets.size != n_doc + 1
        or offsets[0] != 0
        or offsets[-1] != n_tok
        or np.any(np.diff(offsets) < 0)
    ):
        raise DataError(
            f"offsets file {path} does not describe {n_doc} documents of {n_tok} tokens "
            f"(needs {n_doc + 1} non-decreasing offsets from 0 to {n_tok}): re-run "
            f"`trn-accum prepare-data`"
        )
    return offsets


class TokenCorpus:
    """The documents of the prepared directories `path` names (`corpus_dirs`), in order, as
    one stream of ``meta["num_tokens"]`` token ids with document boundaries ``offsets``
    (int64 [documents + 1]). ``read(start, count)`` reads a span that lies within one shard
    (any span within one document does)."""

    def __init__(self, path: str | Sequence[str]):
        self.dirs = corpus_dirs(path)
        self.metas = [read_meta(d) for d in self.dirs]
        check_agree(self.metas, self.dirs)
        check_complete(self.metas, self.dirs)
        self.meta = merged_meta(self.metas, self.dirs)
        counts = [int(m["num_tokens"]) for m in self.metas]
        #: the stream position of each shard's first token
        self.starts = np.cumsum([0, *counts[:-1]], dtype=np.int64)
        parts = [load_offsets(m) for m in self.metas]
        self.offsets = np.concatenate(
            [parts[0][:1], *(p[1:] + s for p, s in zip(parts, self.starts, strict=True))]
        )
        self.files = [TokenFile(m["tokens_path"], m["dtype"], m["num_tokens"]) for m in self.metas]
        one = len(self.dirs) == 1
        self.name = (
            self.dirs[0] if one else f"{len(self.dirs)} shards {self.dirs[0]} .. {self.dirs[-1]}"
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """The set's identity: its one directory's `tokens.fingerprint`, or a digest of the
        shards' fingerprints in order."""
        prints = [fingerprint(m) for m in self.metas]
        if len(prints) == 1:
            return prints[0]
        h = hashlib.blake2b("\n".join(prints).encode(), digest_size=16)
        return "blake2b:" + h.hexdigest()

    def read(self, start: int, count: int) -> np.ndarray:
        """ids [start, start + count) of the stream, from the shard holding `start`."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        return self.files[k].read(int(start) - int(self.starts[k]), count)

    def close(self) -> None:
        for f in self.files:
            f.close()
