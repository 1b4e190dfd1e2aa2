"""Issue 48: prepare-data streams JSONL, .jsonl.gz, .jsonl.zst, Parquet and text in pieces, and
encodes across worker processes: the same documents give the same tokens and fingerprint in
every format and at 1 or 2 workers; bad records are one line naming the file and record; a
killed run leaves nothing that looks complete and the next run starts over."""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trn_accum import cli
from trn_accum.data.corpus_read import _text_cut
from trn_accum.data.datasets import DataError, TokenDataset
from trn_accum.data.prepare import interrupted_files, parse_shard, prepare_data, shard_files
from trn_accum.data.progress import Progress, progress_line
from trn_accum.data.tokens import fingerprint, read_meta

WORDS = "the of and to a in is was he for it with as his on be at by had are but from or".split()
FIELD = "content"
# the suite's JAX has threads; the encoders forked here run no JAX
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choices(WORDS + ["déjà", "ε", "1984"], k=rng.randint(3, 14)))]
        lines += [" ".join(rng.choices(WORDS, k=rng.randint(3, 14))) for _ in range(i % 5)]
        docs.append("\n".join(lines).capitalize() + ".")
    docs[3] = ""  # an empty document is skipped in every format
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = _docs(60)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(d / "tokenizer.json"))
    lines = "".join(json.dumps({"id": i, FIELD: t}) + "\n" for i, t in enumerate(docs))
    (d / "c.jsonl").write_text(lines)
    (d / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    table = pa.table({"id": list(range(len(docs))), FIELD: docs})
    pq.write_table(table, d / "c.parquet", row_group_size=16)
    return d, docs, tok


def _prepare(corpus, names, out, **kw):
    d, _, _ = corpus
    kw.setdefault("chunk_bytes", 512)  # many tasks: the pool interleaves them
    files = [str(d / n) for n in names]
    meta = prepare_data(files, str(out), str(d / "tokenizer.json"), text_field=FIELD, **kw)
    on_disk = read_meta(str(out))
    tokens = np.fromfile(on_disk["tokens_path"], dtype=meta["dtype"])
    return tokens, np.load(on_disk["offsets_path"]), fingerprint(on_disk)


FORMATS = ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet"]


def test_every_format_gives_the_same_tokens_and_fingerprint(corpus, tmp_path):
    _, docs, tok = corpus
    eos = tok.token_to_id("<|endoftext|>")
    expected = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in docs if t]
    ref = None
    for name in FORMATS:
        tokens, offsets, fp = _prepare(corpus, [name], tmp_path / name, workers=1)
        assert offsets.tolist() == np.cumsum([0] + [len(e) for e in expected]).tolist(), name
        assert tokens.tolist() == [i for e in expected for i in e], name
        ref = ref or fp
        assert fp == ref, name


def test_one_and_two_workers_write_the_same_bytes(corpus, tmp_path):
    one = _prepare(corpus, FORMATS, tmp_path / "w1", workers=1)
    two = _prepare(corpus, FORMATS, tmp_path / "w2", workers=2)
    assert np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1])
    assert one[2] == two[2]
    for name in ("tokens.bin", "offsets.npy", "meta.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    offsets = np.load(tmp_path / "w2" / "offsets.npy")
    np.save(tmp_path / "ref.npy", offsets)  # the streamed .npy is np.save's, byte for byte
    assert (tmp_path / "ref.npy").read_bytes() == (tmp_path / "w2" / "offsets.npy").read_bytes()


def test_text_in_pieces_is_the_whole_file_encoded(corpus, tmp_path):
    d, docs, tok = corpus
    text = "\r\n".join(t for t in docs if t) + "\n"  # CRLF: read as text mode reads it
    (tmp_path / "big.txt").write_bytes(text.encode())
    whole = prepare_data(
        [str(tmp_path / "big.txt")], str(tmp_path / "whole"), str(d / "tokenizer.json")
    )
    pieces = prepare_data(
        [str(tmp_path / "big.txt")], str(tmp_path / "pieces"), str(d / "tokenizer.json"),
        chunk_bytes=300, workers=2,
    )  # fmt: skip
    assert whole == {**pieces} and whole["num_documents"] == 1
    eos = tok.token_to_id("<|endoftext|>")
    ids = tok.encode(text.replace("\r\n", "\n"), add_special_tokens=False).ids + [eos]
    on_disk = np.fromfile(tmp_path / "pieces" / "tokens.bin", np.uint16)
    assert on_disk.tolist() == ids
    assert _text_cut(b"ab\ncd \n  ef\n gh") == 3  # after "ab\n": non-space on both sides
    assert _text_cut("ééé".encode()) == 4  # no line break: a UTF-8 character boundary


def _write(path, lines: list[str], compress=None):
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(compress(data) if compress else data)
    return str(path)


@pytest.mark.parametrize("compress", [None, gzip.compress, zstandard.ZstdCompressor().compress])
def test_broken_record_and_missing_field_name_file_and_record(tmp_path, compress):
    ext = {None: "", gzip.compress: ".gz"}.get(compress, ".zst")
    ok = json.dumps({FIELD: "fine"})
    rows = [ok] * 2000 + ['{"content": "broken']  # line 2001, past the first chunk
    bad = _write(tmp_path / f"bad.jsonl{ext}", rows, compress)
    with pytest.raises(DataError) as e:
        prepare_data([bad], str(tmp_path / "o"), text_field=FIELD, workers=2, chunk_bytes=4096)
    assert f"{bad}:2001 is not a JSON object" in str(e.value) and "\n" not in str(e.value)
    missing = _write(tmp_path / f"m.jsonl{ext}", [ok, json.dumps({"text": "x"})], compress)
    with pytest.raises(DataError) as e:
        prepare_data([missing], str(tmp_path / "o"), text_field=FIELD)
    assert f"{missing}:2 has no field 'content'" in str(e.value) and "--text-field" in str(e.value)
    assert not os.path.exists(tmp_path / "o") or os.listdir(tmp_path / "o") == []


def test_parquet_and_compression_errors_are_one_line(tmp_path, monkeypatch):
    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "p.parquet")
    with pytest.raises(DataError) as e:
        prepare_data([str(tmp_path / "p.parquet")], str(tmp_path / "o"))
    assert "has no column 'text'" in str(e.value) and "['body']" in str(e.value)
    with pytest.raises(DataError) as e:
        prepare_data([str(tmp_path / "p.parquet")], str(tmp_path / "o"), text_field="body")
    assert f"{tmp_path / 'p.parquet'}:row 2 field 'body' is NoneType" in str(e.value)
    torn = tmp_path / "t.jsonl.gz"
    torn.write_bytes(gzip.compress(b'{"text": "abc"}\n' * 1000)[:-40])
    with pytest.raises(DataError) as e:
        prepare_data([str(torn)], str(tmp_path / "o"))
    assert f"{torn} is not a valid gzip stream" in str(e.value)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    (tmp_path / "z.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DataError) as e:
        prepare_data([str(tmp_path / "z.jsonl.zst")], str(tmp_path / "o"))
    assert "needs the `zstandard` package" in str(e.value) and "pip install" in str(e.value)
    with pytest.raises(DataError) as e:
        prepare_data([str(torn)], str(tmp_path / "o"), workers=0)
    assert "--workers 0 is not an integer >= 1" in str(e.value)


def _slow_prepare(src: str, out: str) -> None:
    prepare_data([src], out, workers=2, chunk_bytes=1 << 16)


def test_a_killed_run_leaves_nothing_complete_and_the_next_starts_over(tmp_path, capsys):
    src = tmp_path / "big.txt"
    src.write_text(("lorem ipsum dolor sit amet\n" * 40_000) * 12)  # 13 MB
    out = tmp_path / "tok"
    small = tmp_path / "small.txt"
    small.write_text("an earlier, complete preparation\n")
    assert cli.main(["prepare-data", str(small), "--out", str(out)]) == 0
    before = {n: (out / n).read_bytes() for n in ("tokens.bin", "offsets.npy", "meta.json")}
    child = multiprocessing.get_context("fork").Process(
        target=_slow_prepare, args=(str(src), str(out))
    )
    child.start()
    deadline = time.monotonic() + 60
    workers = []
    while len(workers) < 2 or not list(out.glob("tokens.bin.tmp*")):  # the run's own temp
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.01)
        workers = psutil.Process(child.pid).children()
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    gone, alive = psutil.wait_procs(workers, timeout=10)  # they die with it, not orphaned
    assert alive == []
    # the earlier preparation is still whole and loads; the killed run's files are temporary
    assert {n: (out / n).read_bytes() for n in before} == before
    assert TokenDataset(str(out), seq_len=4, batch_size=1).num_train_windows > 0
    assert "tokens.bin.tmp" in interrupted_files(str(out))
    capsys.readouterr()
    assert cli.main(["prepare-data", str(small), "--out", str(out), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "temporary files of an interrupted run (tokens.bin.tmp" in err and "starting over" in err
    assert (
        interrupted_files(str(out)) == []
        and (out / "meta.json").read_bytes() == before["meta.json"]
    )


def test_progress_lines_in_a_log_file(capsys):
    t = [0.0]
    bar = Progress(4_000_000, sys.stderr, interval_s=10, clock=lambda: t[0])
    t[0] = 5
    bar.update(1_000_000, 10, 250_000)  # within the interval: no line yet
    t[0] = 20
    bar.update(1_000_000, 10, 250_000)
    bar.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [progress_line(2_000_000, 4_000_000, 20, 500_000, 20.0)]
    assert err[0] == (
        "prepare-data: 2.0 of 4.0 MB (50%), 20 documents, 500,000 tokens, 0.1 MB/s, ETA 0:00:20"
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    term = _Terminal()
    bar = Progress(4_000_000, term)
    bar.update(1_000_000, 10, 250_000)
    bar.close()
    shown = term.getvalue().replace("\r", "\n").splitlines()[-1]
    assert shown.startswith("prepare-data:  25%|") and "1.00M/4.00M" in shown, shown
    assert "B/s" in shown and "10 docs, 250,000 tokens" in shown, shown


def test_three_shards_in_order_are_the_whole_corpus(corpus, tmp_path, capsys):
    d, docs, _ = corpus
    names = []
    for i in range(7):  # files of uneven sizes, in every format
        part = docs[i * 8 : (i + 1) * 8 + (i % 3) * 4]
        name = f"s{i}.jsonl"
        (d / name).write_text("".join(json.dumps({FIELD: t}) + "\n" for t in part))
        names.append(name)
    whole, whole_offsets, _ = _prepare(corpus, names, tmp_path / "whole", workers=1)
    files = [str(d / n) for n in names]
    parts = [shard_files(files, i, 3) for i in range(3)]
    assert [f for p in parts for f in p] == files and all(parts)
    tokens, offsets = [], [np.zeros(1, np.int64)]
    for i in range(3):
        t, o, _ = _prepare(corpus, names, tmp_path / f"shard{i}", workers=1, shard=(i, 3))
        offsets.append(o[1:] + sum(map(len, tokens)))
        tokens.append(t)
    assert np.array_equal(np.concatenate(tokens), whole)
    assert np.array_equal(np.concatenate(offsets), whole_offsets)
    assert parse_shard("2/3") == (2, 3)
    for bad in ("3/3", "-1/3", "a/b", "2"):
        with pytest.raises(DataError, match="is not I/N with 0 <= I < N"):
            parse_shard(bad)
    with pytest.raises(DataError, match="gets none of the 1 files"):
        shard_files(files[:1], 2, 3)  # one file, three shards: it goes to the middle one
    assert cli.main(["prepare-data", files[0], "--out", str(tmp_path / "x"), "--shard", "4/3"]) == 2
    assert "--shard '4/3' is not I/N" in capsys.readouterr().err


SBATCH = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "launch/slurm/prepare-data.sbatch"
)


def _sbatch_outside_slurm(tmp_path, *args, task="4", first="3"):
    env = dict(
        os.environ, SLURM_ARRAY_TASK_ID=task, SLURM_ARRAY_TASK_MIN=first,
        SLURM_ARRAY_TASK_COUNT="3", SLURM_CPUS_PER_TASK="7", TRN_ACCUM_HOME=str(tmp_path),
        TRN_ACCUM_PREPARE="echo trn-accum prepare-data",
    )  # fmt: skip
    return subprocess.run(["bash", SBATCH, *args], env=env, capture_output=True, text=True)


def test_slurm_array_script_gives_each_task_its_shard(tmp_path):
    r = _sbatch_outside_slurm(tmp_path, "--out", "data/tok", "a.jsonl", "--text-field", "body")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "trn-accum", "prepare-data", "a.jsonl", "--text-field", "body",
        "--out", "data/tok/shard-00001", "--shard", "1/3", "--workers", "7",
    ]  # fmt: skip
    r = _sbatch_outside_slurm(tmp_path, "--out", "d", "--shard", "0/2", "a.jsonl")
    assert r.returncode == 2 and "--shard is set by the array" in r.stderr, r.stderr
    r = _sbatch_outside_slurm(tmp_path, "a.jsonl")
    assert r.returncode == 2 and "--out DIR is missing" in r.stderr, r.stderr
