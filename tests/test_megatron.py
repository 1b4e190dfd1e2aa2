"""Megatron indexed datasets read in place: files written by megatron-core's own
IndexedDatasetBuilder read back token for token, memory-mapped; each bad input one line."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest

from trn_accum.config.files import ConfigError
from trn_accum.config.load import config_from_dict
from trn_accum.data.datasets import DataError, make_dataset
from trn_accum.data.megatron import MegatronCorpus

VOCAB = 1000


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def _documents(seed: int, n: int) -> list[list[np.ndarray]]:
    """n documents, each of 1-3 sequences of 1-40 ids in [0, VOCAB)."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, VOCAB, rng.integers(1, 41)) for _ in range(rng.integers(1, 4))]
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: (prefix, documents)} written with megatron-core's IndexedDatasetBuilder: uint16
    (add_item + end_document), int32 (add_document), float32 (not token ids)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, dtype in (("u16", np.uint16), ("i32", np.int32), ("f32", np.float32)):
        docs = _documents(len(out), 30)
        prefix = str(root / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in docs:
            if name == "i32":
                builder.add_document(np.concatenate(doc), [s.size for s in doc])
            else:
                for seq in doc:
                    builder.add_item(torch.from_numpy(seq))
                builder.end_document()
        builder.finalize(prefix + ".idx")
        out[name] = (prefix, [np.concatenate(d) for d in docs])
    return out


@pytest.mark.parametrize("name", ["u16", "i32"])
def test_reads_back_the_exact_documents_in_place(built, name):
    prefix, docs = built[name]
    corpus = MegatronCorpus(prefix, VOCAB)
    assert corpus.dtype == (np.uint16 if name == "u16" else np.int32)  # from the index
    assert corpus.offsets.size == len(docs) + 1
    for i, doc in enumerate(docs):
        a, b = int(corpus.offsets[i]), int(corpus.offsets[i + 1])
        got = corpus.read(a, b - a)
        np.testing.assert_array_equal(got, doc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        theirs = IndexedDataset(prefix)  # megatron-core's own reader agrees, document by document
        bounds = theirs.document_indices
        for i in range(len(docs)):
            seqs = [theirs[j] for j in range(int(bounds[i]), int(bounds[i + 1]))]
            got = corpus.read(int(corpus.offsets[i]), int(np.diff(corpus.offsets)[i]))
            np.testing.assert_array_equal(got, np.concatenate(seqs))
    assert isinstance(corpus.tokens, np.memmap)
    view = corpus.read(5, 10)
    assert np.shares_memory(view, corpus.tokens) and not view.flags.owndata  # no copy


def test_batches_hold_each_documents_windows(built):
    """One epoch of train rows (no held-out set) is every window of every document once."""
    prefix, docs = built["u16"]
    s = 8
    ds = make_dataset(
        "megatron", path=prefix, seq_len=s, batch_size=4, vocab_size=VOCAB, eval_fraction=0.0
    )
    want = sorted(
        tuple(doc[k : k + s + 1])
        for doc in docs
        if doc.size >= 2
        for k in range(0, doc.size - 1, s)
    )
    n = ds.num_train_windows
    assert n == len(want)
    got = []
    for step in range(-(-n // 4)):
        b = ds.rows(step, np.arange(4))
        for r in range(4):
            if step * 4 + r < n:
                m = int(b["target_mask"][r].sum())
                got.append(tuple(np.append(b["input_ids"][r, :1], b["target_labels"][r, :m])))
    assert sorted(got) == want


def _copy(built, tmp_path, name="u16") -> str:
    prefix = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(built[name][0] + ext, prefix + ext)
    return prefix


def test_missing_idx_beside_bin(built, tmp_path):
    prefix = _copy(built, tmp_path)
    os.remove(prefix + ".idx")
    with pytest.raises(DataError) as e:
        MegatronCorpus(prefix + ".bin", VOCAB)
    assert "no index" in _one_line(e) and prefix + ".idx" in str(e.value)


def test_idx_counts_that_do_not_match_the_bin(built, tmp_path):
    prefix = _copy(built, tmp_path)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError) as e:
        MegatronCorpus(prefix, VOCAB)
    assert "bytes but" in _one_line(e) and ".bin" in str(e.value)
    prefix = _copy(built, tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(DataError) as e:
        MegatronCorpus(prefix, VOCAB)
    assert "header counts" in _one_line(e)


def test_dtype_and_vocab_mismatch(built):
    with pytest.raises(DataError) as e:
        MegatronCorpus(built["f32"][0], VOCAB)
    assert "float32" in _one_line(e) and "not token ids" in str(e.value)
    with pytest.raises(DataError) as e:
        MegatronCorpus(built["u16"][0], 500)  # ids reach 999
    assert "vocab_size=500" in _one_line(e)


def test_every_batch_is_checked_past_the_sample(built, tmp_path):
    """Ids the open-time sample misses (a negative one, one past the vocabulary) are refused
    in the batch that holds them, naming the row and position."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    ids = np.arange(1_000_000, dtype=np.int32) % VOCAB
    ids[40_003], ids[50_005] = -3, VOCAB + 7  # between the sampled blocks
    prefix = str(tmp_path / "long")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(ids, [ids.size])
    builder.finalize(prefix + ".idx")
    ds = make_dataset(
        "megatron", path=prefix, seq_len=8, batch_size=2, vocab_size=VOCAB, eval_fraction=0
    )
    for pos, words in (
        (40_003, "-3 in train step 1, row 5, position 3 is negative"),
        (50_005, f"{VOCAB + 7} in train step 1, row 5, position 5"),
    ):
        windows = ds.read_windows(np.asarray([pos // 8]))
        with pytest.raises(DataError) as e:
            ds.check_windows(windows, np.asarray([5]), "train step 1")
        assert words in _one_line(e)


def test_corpus_too_small_for_one_sequence(built):
    prefix, docs = built["u16"]
    total = sum(d.size for d in docs)
    with pytest.raises(DataError) as e:
        make_dataset("megatron", path=prefix, seq_len=total, batch_size=2, vocab_size=VOCAB)
    assert f"holds {total} tokens" in _one_line(e)


def test_corpus_changed_under_the_job(built, tmp_path):
    prefix = _copy(built, tmp_path)
    ds = make_dataset("megatron", path=prefix, seq_len=8, batch_size=2, vocab_size=VOCAB)
    ds.rows(0, np.arange(2))
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError) as e:
        ds.rows(1, np.arange(2))
    assert "changed under the running job" in _one_line(e)


def test_config_kind_megatron():
    base = {"data": {"kind": "megatron", "seq_len": 16}, "model": {"max_seq_len": 16}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(base)
    assert "data.path" in _one_line(e) and "PREFIX.bin" in str(e.value)
    cfg = config_from_dict({**base, "data": {**base["data"], "path": "/d/web_text_document"}})
    assert cfg.data.kind == "megatron"
