"""`eval --tokens FILE`: every file that is not a whole .npy of integer ids is one line, and
ids are checked against the vocabulary in the file's own dtype, before any cast (a uint64 id
of 2**63 + 5 would wrap to a negative int64, which is padding)."""

import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env, user_error_line
from safetensors.numpy import save_file

from trn_accum.config.load import load_config
from trn_accum.interop import convert, evaluate, hf_io, llama
from trn_accum.interop.llama import InteropError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
BIG = 2**63 + 5


def _npy_bytes(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array))
    return buf.getvalue()


GOOD = _npy_bytes(np.arange(40).reshape(4, 10))


def write_bad(path: Path, case: str) -> Path:
    if case == "empty":
        path.write_bytes(b"")
    elif case == "npz":
        np.savez(path.with_suffix(""), ids=np.arange(10).reshape(2, 5))
        path.with_suffix(".npz").rename(path)
    elif case == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("a.txt", "hi")
    elif case == "text":
        path.write_text("1 2 3\n4 5 6\n")
    elif case == "cut header":
        path.write_bytes(GOOD[:40])
    elif case == "cut data":
        path.write_bytes(GOOD[:-20])
    elif case == "object":
        np.save(path, np.array([[1, 2], [3, None]], dtype=object), allow_pickle=True)
    elif case == "directory":
        path.mkdir()
    return path


CASES = {
    "empty": "an empty file (0 bytes)",
    "npz": "a zip archive (an .npz",
    "zip": "a zip archive",
    "text": "not a .npy file (it starts with b'1 2 3",
    "cut header": "not a readable .npy file",
    "cut data": "not a readable .npy file (Failed to read all data",
    "object": "not a readable .npy file (Object arrays cannot be loaded",
    "directory": "cannot be read (Is a directory)",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unreadable_token_file_is_one_line(tmp_path, case):
    path = write_bad(tmp_path / "t.npy", case)
    with pytest.raises(InteropError) as e:
        evaluate.read_tokens(str(path), 512)
    line = str(e.value)
    assert CASES[case] in line and "np.save(path, ids)" in line and "\n" not in line, line


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32, np.int64])
def test_ids_are_checked_against_the_vocabulary_before_any_cast(tmp_path, dtype):
    path = tmp_path / "t.npy"
    big = BIG if dtype == np.uint64 else 2**31 + 5 if dtype == np.uint32 else 2**62
    ids = np.array([[1, 2, 3, big]], dtype=dtype)
    np.save(path, ids)
    with pytest.raises(InteropError, match=re.escape(f"id {big} at row 0, column 3 is >= the")):
        evaluate.read_tokens(str(path), 512)
    np.save(path, np.array([[1, 2, 3, 511]], dtype=dtype))  # in range: read, nothing padded
    tokens = evaluate.read_tokens(str(path), 512)
    assert tokens.dtype == np.int64 and tokens.tolist() == [[1, 2, 3, 511]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A fuji-tiny run dir at step 0 (import-hf of random safetensors weights)."""
    base = tmp_path_factory.mktemp("eval")
    model = load_config(TINY, []).model
    rng = np.random.default_rng(0)
    hf = base / "hf"
    hf.mkdir()
    tensors = {
        n: (rng.standard_normal(s) * 0.05).astype(np.float32)
        for n, s in convert.hf_shapes(model).items()
    }
    save_file(tensors, str(hf / hf_io.SINGLE))
    (hf / hf_io.CONFIG).write_text(json.dumps(llama.hf_config(model, "float32")))
    convert.import_hf(str(hf), TINY, [], str(base / "run"), say=lambda _: None)
    return base / "run"


def eval_cli(run: Path, tokens: Path):
    return subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", "eval", "--run-dir", str(run)]
        + ["--tokens", str(tokens)],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_eval_names_an_empty_file_and_a_uint64_id_in_one_line(run_dir, tmp_path):
    empty = write_bad(tmp_path / "empty.npy", "empty")
    user_error_line(eval_cli(run_dir, empty), 2, "an empty file (0 bytes)")
    ids = tmp_path / "big.npy"
    np.save(ids, np.array([[1, 2, 3, BIG]], dtype=np.uint64))
    user_error_line(eval_cli(run_dir, ids), 2, f"id {BIG} at row 0, column 3")
