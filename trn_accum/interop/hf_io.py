"""Hugging Face checkpoint files: config.json and safetensors, one file or sharded.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
`model-0000i-of-0000N.safetensors` listed by `model.safetensors.index.json` ({"weight_map":
{tensor name: file}}), the layout transformers' `save_pretrained` writes and reads. Tensors
are read one at a time (`safetensors.safe_open` maps the file; a tensor is read when asked
for) and written one shard at a time through `safetensors.numpy`, so no more than one shard's
tensors are held in memory. bfloat16 is NumPy's `ml_dtypes.bfloat16` (JAX's own).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from trn_accum.interop.llama import InteropError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _load_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise InteropError(f"{path} is missing: {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InteropError(f"{path} cannot be read ({e}): {what}") from None
    if not isinstance(value, dict):
        raise InteropError(f"{path} is not a JSON object: {what}")
    return value


def read_config(directory: str) -> dict:
    """The checkpoint's config.json as a dict."""
    return _load_json(
        os.path.join(directory, CONFIG), "a Hugging Face checkpoint directory has config.json"
    )


def tensor_files(directory: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it: the index's weight_map when the
    directory has `model.safetensors.index.json`, else every tensor of `model.safetensors`."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = _load_json(index, "the index of a sharded checkpoint").get("weight_map")
        if not isinstance(weight_map, dict):
            raise InteropError(f"{index} has no weight_map: re-save the checkpoint")
        return {name: os.path.join(directory, f) for name, f in weight_map.items()}
    single = os.path.join(directory, SINGLE)
    if not os.path.exists(single):
        raise InteropError(
            f"{directory} holds neither {SINGLE} nor {INDEX}: point at a directory that "
            f"save_pretrained(safe_serialization=True) wrote"
        )
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own error types for a bad file
        raise InteropError(f"{path} is not a readable safetensors file ({e})") from None


def tensor_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the files' headers (no tensor data is read)."""
    out = {}
    for path in sorted(set(files.values())):
        with _open(path) as f:
            for name in f.keys():
                if files.get(name) == path:
                    out[name] = tuple(f.get_slice(name).get_shape())
    return out


def read_tensor(files: dict[str, str], name: str) -> np.ndarray:
    """One tensor as float32 (bfloat16 and float16 widen exactly)."""
    with _open(files[name]) as f:
        return np.asarray(f.get_tensor(name), dtype=np.float32)


def plan_shards(sizes: dict[str, int], max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Consecutive groups of tensor names (in the given order) of at most `max_bytes` each
    (a tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_checkpoint(
    directory: str,
    config: dict,
    sizes: dict[str, int],
    tensor: Callable[[str], np.ndarray],
    max_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Writes config.json and the tensors named in `sizes` (name -> bytes, in file order),
    each produced by `tensor(name)` when its shard is written; one shard's tensors in memory
    at a time. One file is `model.safetensors`; more are indexed. Returns the files written."""
    os.makedirs(directory, exist_ok=True)
    shards = plan_shards(sizes, max_bytes)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, group in zip(names, shards, strict=True):
        save_file({n: tensor(n) for n in group}, os.path.join(directory, file), {"format": "pt"})
    written = list(names)
    if len(shards) > 1:
        weight_map = {n: f for f, group in zip(names, shards, strict=True) for n in group}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        _write_json(os.path.join(directory, INDEX), index)
        written.append(INDEX)
    _write_json(os.path.join(directory, CONFIG), config)
    return [*written, CONFIG]


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def missing_or_misshapen(
    have: dict[str, tuple[int, ...]], want: Iterable[tuple[str, tuple[int, ...]]]
) -> list[str]:
    """'name shape (needs shape)' / 'name missing' for each wanted tensor that differs."""
    return [
        f"{n} missing" if n not in have else f"{n} {list(have[n])} (needs {list(s)})"
        for n, s in want
        if have.get(n) != tuple(s)
    ]
