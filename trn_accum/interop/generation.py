"""What generation needs from a Hugging Face checkpoint, carried from `import-hf` to `export-hf`.

transformers' `generate` stops at `eos_token_id` (an id or a list of ids) and starts from
`bos_token_id`; it reads them from `generation_config.json`, else from config.json. Our model
has no use for them, so `import-hf` keeps them beside the run's config record, in
``RUN_DIR/hf_generation.json``, with the checkpoint's original `max_position_embeddings`:

    {"bos_token_id": 128000, "eos_token_id": 128001, "max_position_embeddings": 131072}

`export-hf` writes them back into config.json and writes generation_config.json (the token
ids). Flags of `export-hf` (`--bos-token-id`, `--eos-token-id`, `--pad-token-id`) set or
replace them, e.g. for a run trained from scratch. RoPE scaling is not kept here: import-hf
refuses a type the model does not compute, and export writes the model config's own RoPE.
"""

from __future__ import annotations

import json
import os

from trn_accum.checkpoint import rundir
from trn_accum.interop import hf_io
from trn_accum.interop.llama import InteropError

FILE = "hf_generation.json"
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
CONTEXT = "max_position_embeddings"


def _flag(key: str) -> str:
    return key.replace("_", "-")


def _valid(value, vocab_size: int, many: bool = False) -> bool:
    ids = value if many and isinstance(value, list) else [value]
    ints = bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    return ints and all(0 <= i < vocab_size for i in ids)


def check_ids(key: str, value, vocab_size: int, where: str, fix: str):
    """`value` (an int, or a non-empty list of ints for eos_token_id) when every id is in
    [0, vocab_size); InteropError naming `key`, the value, `where` it came from and `fix`."""
    if not _valid(value, vocab_size, many=key == "eos_token_id"):
        raise InteropError(
            f"{key} {value!r} ({where}) is not a token id in [0, {vocab_size}) (eos_token_id "
            f"may be a list of them): {fix}"
        )
    return value


def from_hf(hf_dir: str, vocab_size: int) -> dict:
    """The token ids and context length of the checkpoint in `hf_dir`: config.json's, with
    generation_config.json's ids in their place where it has them (what `generate` reads).
    Ids are checked against `vocab_size`; null ids, and a pad_token_id that is no token id
    (-1 in some configs), are left out."""
    hf = hf_io.read_config(hf_dir)
    gen_path = os.path.join(hf_dir, hf_io.GENERATION_CONFIG)
    gen = {}
    if os.path.exists(gen_path):
        gen = hf_io.read_json(gen_path, "transformers' generation config")
    out = {}
    for key in TOKEN_KEYS:
        where = gen_path if gen.get(key) is not None else os.path.join(hf_dir, hf_io.CONFIG)
        value = gen[key] if where == gen_path else hf.get(key)
        if key == "pad_token_id" and not _valid(value, vocab_size):
            continue  # none, or a placeholder such as -1: generation does not need one
        if value is not None:
            fix = f"correct it in {where}, or remove it and pass --{_flag(key)} to export-hf"
            out[key] = check_ids(key, value, vocab_size, where, fix)
    if isinstance(hf.get(CONTEXT), int):
        out[CONTEXT] = hf[CONTEXT]
    return out


def save(run_dir: str, fields: dict) -> None:
    """Writes `fields` (`from_hf`) to RUN_DIR/hf_generation.json (atomic)."""
    rundir.write_atomic(os.path.join(run_dir, FILE), json.dumps(fields, indent=2) + "\n")


def load(run_dir: str) -> dict:
    """What `save` wrote into `run_dir`, or {} for a run that was not imported."""
    path = os.path.join(run_dir, FILE)
    if not os.path.exists(path):
        return {}
    return hf_io.read_json(path, "import-hf writes it; remove it to export without it")


def export_fields(saved: dict, overrides: dict, vocab_size: int, max_seq_len: int):
    """(the fields config.json gets, generation_config.json): the token ids of `overrides`
    (flags, checked against `vocab_size`) over the `saved` ones; max_position_embeddings the
    larger of the original one and `max_seq_len` (what the run trained on)."""
    ids = {k: saved[k] for k in TOKEN_KEYS if saved.get(k) is not None}
    for key, value in overrides.items():
        if value is not None:
            fix = "pass an id of the model's vocabulary"
            ids[key] = check_ids(key, value, vocab_size, f"--{_flag(key)}", fix)
    context = max(int(saved.get(CONTEXT) or 0), max_seq_len)
    return {**ids, CONTEXT: context}, ids
