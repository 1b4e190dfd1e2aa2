"""Hugging Face datasets saved with save_to_disk read in place: the `input_ids` of files that
`datasets` wrote read back exactly, memory-mapped; each bad input one line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from trn_accum.data.datasets import DataError, make_dataset
from trn_accum.data.hf_arrow import ArrowCorpus

VOCAB = 700


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def _rows(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(0, 50)).tolist() for _ in range(n)]


WRITE = """
import sys
import datasets
import numpy as np

root, rows = sys.argv[1], [r.tolist() for r in np.load(sys.argv[2], allow_pickle=True)]
ids64 = datasets.Sequence(datasets.Value("int64"))
wide = datasets.Features({"input_ids": ids64, "text": datasets.Value("string")})
plain = datasets.Dataset.from_dict({"input_ids": rows, "text": ["x"] * len(rows)}, features=wide)
plain.save_to_disk(root + "/int64", num_shards=3)
feats = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
narrow = datasets.Dataset.from_dict({"input_ids": rows}, features=feats)
narrow.select(range(5, len(rows))).save_to_disk(root + "/int32", num_shards=2)
fixed = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("uint16"), length=6)})
packed = [r[:6] for r in rows if len(r) >= 6]
datasets.Dataset.from_dict({"input_ids": packed}, features=fixed).save_to_disk(root + "/uint16")
datasets.Dataset.from_dict({"tokens": rows}).save_to_disk(root + "/nocol")
datasets.Dataset.from_dict({"input_ids": [[0.5, 1.5]]}).save_to_disk(root + "/float")
datasets.DatasetDict({"train": plain}).save_to_disk(root + "/dict")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directories `datasets` wrote (in a child process: this suite's tests/multiprocess.py
    would shadow the `multiprocess` package `datasets` imports)."""
    root = tmp_path_factory.mktemp("hf")
    rows = _rows(0, 40)
    arr = np.empty(len(rows), object)
    arr[:] = [np.asarray(r, np.int64) for r in rows]
    np.save(root / "rows.npy", arr, allow_pickle=True)
    subprocess.run(
        [sys.executable, "-c", WRITE, str(root), str(root / "rows.npy")],
        cwd=root,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root, rows


@pytest.mark.parametrize("name,first", [("int64", 0), ("int32", 5)])
def test_reads_back_the_exact_rows_in_place(saved, name, first):
    root, rows = saved
    corpus = ArrowCorpus(str(root / name), VOCAB)
    rows = rows[first:]
    assert corpus.meta["dtype"] == name and corpus.offsets.size == len(rows) + 1
    for i, row in enumerate(rows):
        a, b = int(corpus.offsets[i]), int(corpus.offsets[i + 1])
        got = corpus.read(a, b - a)
        assert got.tolist() == row
    assert len(corpus.files) > 1
    assert not corpus.read(0, 4).flags.owndata  # a view of the memory-mapped Arrow buffer


def test_fixed_length_rows(saved):
    """Sequence(..., length=6): a fixed-size list column, rows of 6 ids each."""
    root, rows = saved
    corpus = ArrowCorpus(str(root / "uint16"), VOCAB)
    want = [r[:6] for r in rows if len(r) >= 6]
    assert corpus.meta["dtype"] == "uint16" and np.all(np.diff(corpus.offsets) == 6)
    assert [corpus.read(6 * i, 6).tolist() for i in range(len(want))] == want


def test_batches_from_an_hf_dataset(saved):
    root, rows = saved
    ds = make_dataset(
        "hf", path=str(root / "int64"), seq_len=8, batch_size=4, vocab_size=VOCAB, seed=1
    )
    b = ds.rows(3, np.arange(4))
    ids = set(np.concatenate(rows).tolist())
    assert set(b["input_ids"][b["target_mask"] > 0].tolist()) <= ids
    again = make_dataset(
        "hf", path=str(root / "int64"), seq_len=8, batch_size=4, vocab_size=VOCAB, seed=1
    ).rows(3, np.arange(4))
    for k in b:
        np.testing.assert_array_equal(b[k], again[k])


@pytest.mark.parametrize(
    "name,vocab,words",
    [
        ("nocol", VOCAB, "no 'input_ids' column"),
        ("float", VOCAB, "not a list of integer token ids"),
        ("dict", VOCAB, "is a DatasetDict"),
        ("int64", 300, "vocab_size=300"),
        ("missing", VOCAB, "not a directory"),
    ],
)
def test_bad_datasets_one_line(saved, name, vocab, words):
    root, _ = saved
    with pytest.raises(DataError) as e:
        ArrowCorpus(str(root / name), vocab)
    assert words in _one_line(e)


def test_too_small_for_one_sequence(saved):
    root, rows = saved
    n = sum(len(r) for r in rows)
    with pytest.raises(DataError) as e:
        make_dataset("hf", path=str(root / "int64"), seq_len=n, batch_size=1, vocab_size=VOCAB)
    assert f"holds {n} tokens" in _one_line(e)


def test_arrow_file_changed_under_the_job(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root / "int64", tmp_path / "copy")
    ds = make_dataset("hf", path=str(tmp_path / "copy"), seq_len=8, batch_size=2, vocab_size=VOCAB)
    ds.rows(0, np.arange(2))
    victim = sorted((tmp_path / "copy").glob("*.arrow"))[-1]
    victim.write_bytes(victim.read_bytes()[:100])  # rewritten while the job reads it
    with pytest.raises(DataError) as e:
        ds.rows(1, np.arange(2))
    assert "changed under the running job" in _one_line(e) and victim.name in str(e.value)
