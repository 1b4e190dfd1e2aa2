"""Hugging Face checkpoint files: config.json and safetensors, one file or sharded.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
`model-0000i-of-0000N.safetensors` listed by `model.safetensors.index.json` ({"weight_map":
{tensor name: file}}, each file a name inside the directory: `tensor_files` refuses any other
value), the layout transformers' `save_pretrained` writes and reads. Tensors
are read one at a time (`safetensors.safe_open` maps the file; a tensor is read when asked
for) and written one shard at a time through `safetensors.numpy`, so no more than one shard's
tensors are held in memory. bfloat16 is NumPy's `ml_dtypes.bfloat16` (JAX's own). A
directory is written whole: into a fresh sibling that then replaces it (`out_dir`).
Reading refuses what is not float weights (`trn_accum.interop.validate`): a tensor's dtype is
taken from the file's header before any conversion, and each tensor read is checked finite.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from trn_accum.errors import listed
from trn_accum.interop import out_dir, validate
from trn_accum.interop.llama import InteropError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # what transformers' generate reads first
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def read_json(path: str, what: str) -> dict:
    """The JSON object in `path`; InteropError naming it, and `what` it should be, when it
    is missing, unreadable or not an object."""
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
    return read_json(
        os.path.join(directory, CONFIG), "a Hugging Face checkpoint directory has config.json"
    )


def tensor_files(directory: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it: the index's weight_map when the
    directory has `model.safetensors.index.json`, else every tensor of `model.safetensors`."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = read_json(index, "the index of a sharded checkpoint").get("weight_map")
        if not isinstance(weight_map, dict):
            raise InteropError(f"{index} has no weight_map: re-save the checkpoint")
        bad = [f"{name}: {f!r}" for name, f in weight_map.items() if not _inside(f)]
        if bad:
            raise InteropError(
                f"{index} weight_map maps tensors to what is not a file of the checkpoint "
                f"directory ({listed(bad)}): each value must be the name of a "
                f'safetensors file beside the index (e.g. "model-00001-of-00002.safetensors"); '
                f"re-save the checkpoint"
            )
        return {name: os.path.join(directory, f) for name, f in weight_map.items()}
    single = os.path.join(directory, SINGLE)
    if not os.path.exists(single):
        raise InteropError(
            f"{directory} holds neither {SINGLE} nor {INDEX}: point at a directory that "
            f"save_pretrained(safe_serialization=True) wrote"
        )
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _inside(name) -> bool:
    """Whether an index value `name` names a file inside the checkpoint directory: a
    non-empty relative path string that neither climbs out ("..") nor names the directory."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        return False
    parts = name.replace("\\", "/").split("/")
    return ".." not in parts and os.path.normpath(name) not in (".", "")


def stored_names(files: dict[str, str]) -> dict[str, str]:
    """Every tensor stored in the files of `files` (from `tensor_files`) -> its file, those
    the index does not list included (headers only)."""
    out = {}
    for path in sorted(set(files.values())):
        with _open(path) as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own error types for a bad file
        raise InteropError(f"{path} is not a readable safetensors file ({e})") from None


def tensor_headers(files: dict[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype such as "BF16" or "F8_E4M3", shape), from the files'
    headers: no tensor data is read or converted."""
    out = {}
    for path in sorted(set(files.values())):
        with _open(path) as f:
            for name in f.keys():
                if files.get(name) == path:
                    header = f.get_slice(name)
                    out[name] = (header.get_dtype(), tuple(header.get_shape()))
    return out


# bytes per element of the dtypes a checkpoint may hold (`validate.FLOAT_DTYPES`)
ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def stored_bytes(files: dict[str, str], names: Iterable[str]) -> dict[str, int]:
    """Tensor name -> its bytes in its file, for each of `names` (from the headers)."""
    headers = tensor_headers(files)
    return {n: int(np.prod(headers[n][1])) * ITEM_BYTES[headers[n][0]] for n in names}


def read_tensor(files: dict[str, str], name: str) -> np.ndarray:
    """One tensor as float32 (bfloat16 and float16 widen exactly). InteropError, naming it,
    when its stored dtype is not a float weight dtype (checked in the header, before any
    conversion) or it holds NaN/Inf (`validate`)."""
    with _open(files[name]) as f:
        validate.refuse_quantized_tensors({name: f.get_slice(name).get_dtype()}, files[name])
        value = np.asarray(f.get_tensor(name), dtype=np.float32)
    validate.refuse_nonfinite(name, value, files[name])
    return value


def tensors_equal(files: dict[str, str], a: str, b: str, rows: int = 4096) -> bool:
    """Whether float tensors `a` and `b` have one shape and equal values (compared as float32,
    `rows` leading rows at a time: never a whole tensor in memory)."""
    with _open(files[a]) as fa, _open(files[b]) as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()):
            return False
        if not shape:
            return bool(np.float32(fa.get_tensor(a)) == np.float32(fb.get_tensor(b)))
        for start in range(0, shape[0], rows):
            block = slice(start, min(start + rows, shape[0]))  # safetensors does not clip
            x = np.asarray(sa[block], dtype=np.float32)
            if not np.array_equal(x, np.asarray(sb[block], dtype=np.float32)):
                return False
    return True


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


# Weight files of any format (never carried from a previous export into a new one)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")


def looks_exported(directory: str, names: list[str]) -> bool:
    """Whether the files `names` of `directory` are a Hugging Face checkpoint: a *.safetensors
    file, or a config.json with a model_type."""
    if any(n.endswith(".safetensors") for n in names):
        return True
    try:
        with open(os.path.join(directory, CONFIG), encoding="utf-8") as f:
            return "model_type" in json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def check_out_dir(directory: str) -> None:
    """InteropError (one line) when `directory` exists and is not empty, nor a Hugging Face
    checkpoint of files only, that an export may replace whole."""
    out_dir.check(directory, lambda names: looks_exported(directory, names))


def _carried(name: str, written: list[str]) -> bool:
    """Whether a file of the previous export goes on into the new one: not a file an export
    writes, nor weights (of any format), so no stale shard, index or config survives."""
    ours = (*written, CONFIG, GENERATION_CONFIG)
    return name not in ours and not name.endswith(WEIGHT_SUFFIXES)


def write_checkpoint(
    directory: str,
    config: dict,
    sizes: dict[str, int],
    tensor: Callable[[str], np.ndarray],
    max_bytes: int = SHARD_BYTES,
    extra: dict[str, dict] | None = None,
) -> list[str]:
    """Writes config.json, the JSON files of `extra` (file name -> value) and the tensors named
    in `sizes` (name -> bytes, in file order), each produced by `tensor(name)` when its shard
    is written; one shard's tensors in memory at a time. One file is `model.safetensors`; more
    are indexed. The directory is replaced whole (`trn_accum.interop.out_dir`): a kill leaves
    the previous content or the new one. Returns the files written."""
    check_out_dir(directory)
    with out_dir.fresh(directory) as tmp:
        try:
            written = _write_files(tmp, config, sizes, tensor, max_bytes, extra or {})
            out_dir.commit(tmp, directory, lambda name: _carried(name, written))
        except (OSError, SafetensorError):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return written


def _write_files(directory, config, sizes, tensor, max_bytes, extra) -> list[str]:
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
    for file, value in {**extra, CONFIG: config}.items():
        _write_json(os.path.join(directory, file), value)
        written.append(file)
    return written


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
