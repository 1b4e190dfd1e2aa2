"""Datasets: determinism, windows and padding, held-out split, errors, process-local batches."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import xla_flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess import tagged_json

from trn_accum.data.datasets import (
    DataError,
    SyntheticDataset,
    TokenDataset,
    check_vocab,
    global_batch,
    make_dataset,
    process_rows,
    read_meta,
)
from trn_accum.data.prepare import prepare_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and ": " in msg, msg
    return msg


def _check_batch(batch, b, s, vocab):
    assert set(batch) == {"input_ids", "target_labels", "target_mask"}
    assert batch["input_ids"].shape == batch["target_labels"].shape == (b, s)
    assert batch["input_ids"].dtype == np.int32 and batch["target_labels"].dtype == np.int32
    assert batch["target_mask"].dtype == np.float32
    assert batch["input_ids"].min() >= 0 and batch["input_ids"].max() < vocab
    assert batch["target_labels"].max() < vocab
    # targets are the next input token wherever both are real
    m = batch["target_mask"][:, :-1] > 0
    assert np.array_equal(batch["target_labels"][:, :-1][m], batch["input_ids"][:, 1:][m])
    # the mask is a prefix of ones (no holes)
    mask = batch["target_mask"]
    assert np.all(np.diff(mask, axis=1) <= 0)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_subsets_and_padding():
    ds = SyntheticDataset(vocab_size=100, seq_len=32, batch_size=16, seed=3)
    full = ds.rows(5, np.arange(16))
    _check_batch(full, 16, 32, 100)
    again = SyntheticDataset(vocab_size=100, seq_len=32, batch_size=16, seed=3).rows(
        5, np.arange(16)
    )
    for k in full:
        assert np.array_equal(full[k], again[k])
    part = ds.rows(5, np.array([3, 11]))
    for k in full:
        assert np.array_equal(part[k], full[k][[3, 11]])
    other_step = ds.rows(6, np.arange(16))
    assert not np.array_equal(other_step["input_ids"], full["input_ids"])
    other_seed = SyntheticDataset(vocab_size=100, seq_len=32, batch_size=16, seed=4)
    assert not np.array_equal(other_seed.rows(5, np.arange(16))["input_ids"], full["input_ids"])
    ev = ds.rows(5, np.arange(16), split="eval")
    assert not np.array_equal(ev["input_ids"], full["input_ids"])
    # uneven real-token counts across rows, padding id 0 after the end
    counts = [ds.rows(s, np.arange(16))["target_mask"].sum(1) for s in range(4)]
    counts = np.concatenate(counts)
    assert counts.max() == 32 and counts.min() < 32 and counts.min() >= 1
    padded = full["target_mask"] == 0
    assert np.all(full["target_labels"][padded] == 0)


def test_synthetic_is_learnable():
    """A bigram table fitted on train rows predicts eval rows far better than uniform."""
    vocab, s = 512, 64
    ds = SyntheticDataset(vocab_size=vocab, seq_len=s, batch_size=32, seed=0)
    counts = np.full((vocab, vocab), 0.01)
    for step in range(8):
        b = ds.rows(step, np.arange(32))
        m = b["target_mask"] > 0
        np.add.at(counts, (b["input_ids"][m], b["target_labels"][m]), 1)
    probs = counts / counts.sum(1, keepdims=True)
    ev = ds.rows(0, np.arange(32), split="eval")
    m = ev["target_mask"] > 0
    nll = -np.log(probs[ev["input_ids"][m], ev["target_labels"][m]]).mean()
    assert nll < 1.5 < np.log(vocab) - 4  # ln(512) = 6.24


# --------------------------------------------------------------------------- prepare-data


def _corpus(tmp_path, texts):
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(t, encoding="utf-8")
        paths.append(str(p))
    return paths


def test_prepare_bytes_roundtrip(tmp_path):
    texts = ["héllo\n", "", "abc"]
    jl = tmp_path / "more.jsonl"
    jl.write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    files = _corpus(tmp_path, texts) + [str(jl)]
    meta = prepare_data(files, str(tmp_path / "out"))
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["eos_id"] == 256
    assert meta["tokenizer"] == "bytes"
    expected_docs = [t.encode() for t in ["héllo\n", "abc", "xy", "z"]]
    assert meta["num_documents"] == 4
    assert meta["num_tokens"] == sum(len(d) + 1 for d in expected_docs)
    on_disk = read_meta(str(tmp_path / "out"))
    tokens = np.fromfile(on_disk["tokens_path"], dtype=np.uint16)
    offsets = np.load(on_disk["offsets_path"])
    for i, d in enumerate(expected_docs):
        doc = tokens[offsets[i] : offsets[i + 1]]
        assert bytes(doc[:-1].astype(np.uint8)) == d and doc[-1] == 256


def test_windows_padding_and_epoch_coverage(tmp_path):
    """Every target of every document appears exactly once per pass over all windows."""
    s = 8
    texts = ["a" * 3, "b" * 8, "c" * 20, "d" * 40, "e"]  # +eos each: 4, 9, 21, 41, 2 tokens
    prepare_data(_corpus(tmp_path, texts), str(tmp_path / "out"))
    ds = TokenDataset(str(tmp_path / "out"), seq_len=s, batch_size=4, eval_fraction=0.0)
    # windows per doc: ceil((n-1)/8) = 1, 1, 3, 5, 1
    assert ds.num_train_windows == 11 and not ds.eval_disjoint
    # one epoch = 11 samples: steps 0..2 of batch 4 cover samples 0..11
    ids = np.concatenate([ds.window_ids(st, np.arange(4)) for st in range(3)])[:11]
    assert sorted(ids.tolist()) == list(range(11))
    seen = []
    for st in range(3):
        b = ds.rows(st, np.arange(4))
        _check_batch(b, 4, s, 257)
        for r in range(4):
            if st * 4 + r >= 11:
                break
            m = b["target_mask"][r] > 0
            pairs = zip(
                b["input_ids"][r][m].tolist(), b["target_labels"][r][m].tolist(), strict=True
            )
            seen.extend(pairs)
    # targets: per doc of n tokens, n-1 (input, target) pairs; 3+8+20+40+1 = 72
    assert len(seen) == 72
    assert seen.count((ord("d"), ord("d"))) == 39 and seen.count((ord("d"), 256)) == 1
    assert seen.count((ord("e"), 256)) == 1
    # the short document is padded with mask 0 (no packing of the next document)
    short = [
        ds.rows(st, np.array([r]))
        for st in range(3)
        for r in range(4)
        if st * 4 + r < 11 and ds.rows(st, np.array([r]))["input_ids"][0, 0] == ord("a")
    ]
    assert len(short) == 1
    assert short[0]["target_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert short[0]["input_ids"][0, 3:].tolist() == [256] * 5


def test_token_rows_depend_only_on_seed_and_step(tmp_path):
    prepare_data(_corpus(tmp_path, ["x" * 30 + str(i) for i in range(12)]), str(tmp_path / "o"))
    a = TokenDataset(str(tmp_path / "o"), seq_len=8, batch_size=6, seed=1)
    b = TokenDataset(str(tmp_path / "o"), seq_len=8, batch_size=6, seed=1)
    for st in range(7):  # a runs through several epochs first; b jumps straight to step 6
        a.rows(st, np.arange(6))
    ra, rb = a.rows(6, np.arange(6)), b.rows(6, np.arange(6))
    for k in ra:
        assert np.array_equal(ra[k], rb[k])
    part = b.rows(6, np.array([1, 4]))
    assert np.array_equal(part["input_ids"], ra["input_ids"][[1, 4]])
    c = TokenDataset(str(tmp_path / "o"), seq_len=8, batch_size=6, seed=2)
    assert not np.array_equal(c.window_ids(0, np.arange(6)), a.window_ids(0, np.arange(6)))


def test_eval_split_is_held_out_documents(tmp_path):
    texts = [chr(ord("A") + i) * 12 for i in range(20)]
    prepare_data(_corpus(tmp_path, texts), str(tmp_path / "o"))
    ds = TokenDataset(str(tmp_path / "o"), seq_len=4, batch_size=4, eval_fraction=0.1)
    assert ds.eval_disjoint and ds.num_eval_windows == 2 * 3 and ds.num_train_windows == 18 * 3

    def letters(split, steps):
        out = set()
        for st in range(steps):
            b = ds.rows(st, np.arange(4), split)
            out |= set(b["input_ids"][b["target_mask"] > 0].tolist())
        return out - {256}

    ev, tr = letters("eval", 3), letters("train", 14)
    assert len(ev) == 2 and len(tr) == 18 and not ev & tr
    e1 = ds.rows(2, np.arange(4), "eval")
    e2 = TokenDataset(str(tmp_path / "o"), seq_len=4, batch_size=4, eval_fraction=0.1).rows(
        2, np.arange(4), "eval"
    )
    assert np.array_equal(e1["input_ids"], e2["input_ids"])
    # a single long document: the last windows are held out
    prepare_data(_corpus(tmp_path, ["q" * 100]), str(tmp_path / "one"))
    one = TokenDataset(str(tmp_path / "one"), seq_len=10, batch_size=2, eval_fraction=0.2)
    assert (one.num_train_windows, one.num_eval_windows) == (8, 2) and one.eval_disjoint


# --------------------------------------------------------------------------- errors


def test_errors_are_one_line(tmp_path):
    prepare_data(_corpus(tmp_path, ["hello world"] * 3), str(tmp_path / "o"))
    out = str(tmp_path / "o")

    with pytest.raises(DataError) as e:
        TokenDataset(str(tmp_path / "missing"), seq_len=4, batch_size=2)
    assert "missing" in _one_line(e) and "prepare-data" in str(e.value)

    with pytest.raises(DataError) as e:  # vocab 257 > model vocab 200
        make_dataset("tokens", path=out, seq_len=4, batch_size=2, vocab_size=200)
    assert "257" in _one_line(e) and "200" in str(e.value)
    check_vocab(read_meta(out), 257)
    with pytest.raises(DataError):
        check_vocab({"vocab_size": 100, "max_token_id": 150}, 120)

    with pytest.raises(DataError) as e:
        make_dataset(
            "tokens", path=out, seq_len=4096, batch_size=2, vocab_size=300, max_seq_len=2048
        )
    assert "4096" in _one_line(e) and "2048" in str(e.value)
    with pytest.raises(DataError):
        make_dataset("synthetic", seq_len=0, batch_size=2, vocab_size=300)
    with pytest.raises(DataError) as e:
        make_dataset("parquet", seq_len=4, batch_size=2, vocab_size=300)
    _one_line(e)

    with pytest.raises(DataError) as e:
        prepare_data(_corpus(tmp_path, ["", ""]), str(tmp_path / "empty"))
    assert "empty" in _one_line(e)
    with pytest.raises(DataError) as e:
        prepare_data([str(tmp_path / "nope.txt")], str(tmp_path / "x"))
    assert "nope.txt" in _one_line(e)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(DataError) as e:
        prepare_data([str(bad)], str(tmp_path / "x"))
    assert "bad.jsonl:2" in _one_line(e)

    # truncated token file: one token short
    tokens = os.path.join(out, "tokens.bin")
    size = os.path.getsize(tokens)
    with open(tokens, "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(DataError) as e:
        TokenDataset(out, seq_len=4, batch_size=2)
    assert "tokens.bin" in _one_line(e) and str(size - 2) in str(e.value)

    with pytest.raises(DataError) as e:
        global_batch(
            SyntheticDataset(vocab_size=10, seq_len=4, batch_size=8), 0, 16, _sharding((8,), P())
        )
    _one_line(e)


def test_prepare_data_of_a_directory_and_failures_leave_no_temporary_file(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("hello")
    with pytest.raises(DataError) as e:
        prepare_data([str(docs)], str(tmp_path / "o"))
    msg = _one_line(e)
    assert "is a directory" in msg and f"{docs}/*.txt" in msg and "does not exist" not in msg
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    for files in (
        [str(docs / "a.txt"), str(bad)],
        [str(docs / "a.txt"), str(tmp_path / "x.jsonl")],
    ):
        if files[1].endswith(".jsonl"):
            (tmp_path / "x.jsonl").write_text('{"text": 1}\nnot json\n')
        with pytest.raises(DataError):
            prepare_data(files, str(tmp_path / "o"))
        assert sorted(os.listdir(tmp_path / "o")) == []  # no tokens.bin.tmp left behind


@pytest.mark.parametrize(
    "garbage, needle",
    [
        (b"\xff\xfe\x00\x01 torn", "not readable JSON"),
        (b'{"dtype": "uint16", "vocab_si', "not readable JSON"),
        (b"[1, 2, 3]", "lacks dtype"),
        ({"num_tokens": "many"}, "num_tokens = 'many' is not an integer >= 0"),
        ({"vocab_size": None}, "vocab_size = None is not an integer >= 1"),
        ({"eos_id": -3}, "eos_id = -3"),
        ({"dtype": ["uint16"]}, "is not uint16/uint32"),
        ({"dtype": "float64"}, "is not uint16/uint32"),
        ({"tokens_file": "../../etc/passwd"}, "is not a file name beside it"),
        ({"offsets_file": 7}, "offsets_file = 7"),
        ({"max_token_id": 1.5}, "max_token_id = 1.5"),
    ],
)
def test_garbage_meta_json_is_a_one_line_error(tmp_path, garbage, needle):
    out = tmp_path / "o"
    prepare_data(_corpus(tmp_path, ["hello world"] * 3), str(out))
    if isinstance(garbage, dict):
        meta = json.loads((out / "meta.json").read_text())
        meta.update(garbage)
        (out / "meta.json").write_text(json.dumps(meta))
    else:
        (out / "meta.json").write_bytes(garbage)
    with pytest.raises(DataError) as e:
        TokenDataset(str(out), seq_len=4, batch_size=2)
    assert needle in _one_line(e) and str(out / "meta.json") in str(e.value)


def test_hf_tokenizer_or_clear_error(tmp_path):
    text = _corpus(tmp_path, ["the cat sat"])
    try:
        import tokenizers
    except ImportError:
        fake = tmp_path / "tokenizer.json"
        fake.write_text("{}")
        with pytest.raises(DataError) as e:
            prepare_data(text, str(tmp_path / "o"), tokenizer=str(fake))
        assert "`tokenizers`" in _one_line(e)
        return
    from tokenizers import models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    meta = prepare_data(text, str(tmp_path / "o"), tokenizer=str(tmp_path / "tokenizer.json"))
    assert meta["vocab_size"] == 5 and meta["eos_id"] == 0 and meta["num_tokens"] == 4
    assert np.fromfile(read_meta(str(tmp_path / "o"))["tokens_path"], np.uint16).tolist() == [
        2,
        3,
        4,
        0,
    ]


# --------------------------------------------------------------------------- global batches


def _sharding(shape, spec):
    names = ("data", "fsdp", "model")[: len(shape)]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    return NamedSharding(mesh, spec)


@pytest.mark.parametrize(
    "mesh_shape,spec",
    [((2, 4), P(("data", "fsdp"))), ((2, 2, 2), P(("data", "fsdp"))), ((8,), P())],
)
def test_global_batch_single_process(mesh_shape, spec):
    ds = SyntheticDataset(vocab_size=64, seq_len=16, batch_size=16, seed=0)
    sh = _sharding(mesh_shape, spec)
    batch = global_batch(ds, 7, 16, sh)
    ref = ds.rows(7, np.arange(16))
    for k, v in batch.items():
        assert v.shape == (16, 16) and v.sharding == sh
        assert np.array_equal(np.asarray(v), ref[k])
    assert np.array_equal(process_rows(sh, (16, 16)), np.arange(16))


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import jax
    pid = int(sys.argv[1])
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=pid)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from trn_accum.data.datasets import SyntheticDataset, global_batch

    class Spy(SyntheticDataset):
        asked = []
        def rows(self, step, row_indices, split="train"):
            Spy.asked.extend(np.asarray(row_indices).tolist())
            return super().rows(step, row_indices, split)

    ds = Spy(vocab_size=64, seq_len=8, batch_size=16, seed=0)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"))
    b = global_batch(ds, 3, 16, NamedSharding(mesh, P(("data", "fsdp"))))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    f = jax.jit(lambda x: {k: (v.astype(np.float32) * w).sum() for k, v in x.items()})
    out = {k: float(v) for k, v in f(b).items()}
    # one string, one write: gloo's threads write to this stdout too, between print's pieces
    print("RESULT " + json.dumps({"asked": Spy.asked, "sums": out}), flush=True)
    jax.distributed.shutdown()
    # the result is out and both ranks passed shutdown's barrier: end without the interpreter's
    # teardown, which once in about eight suite runs on 2 loaded cores never ended (both ranks
    # had run their atexit handlers 2 s in; the test then waited out its 120 s)
    os._exit(0)
    """
)


def test_global_batch_two_processes_read_only_their_rows():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(4),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(tagged_json(out, "RESULT "))  # gloo shares the rank's stdout
    asked = [sorted(r["asked"]) for r in results]
    assert asked[0] == list(range(8)) and asked[1] == list(range(8, 16))
    ref = SyntheticDataset(vocab_size=64, seq_len=8, batch_size=16, seed=0).rows(3, np.arange(16))
    w = np.arange(16 * 8, dtype=np.float64).reshape(16, 8)
    for r in results:
        for k in ref:
            assert r["sums"][k] == pytest.approx(float((ref[k] * w).sum()), rel=1e-6)
