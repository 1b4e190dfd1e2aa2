"""prepare-data's output is one run's: a second run into a locked --out is refused naming the
holder (two real processes), the loader refuses a tokens.bin or offsets.npy its meta.json does
not vouch for, and --out may be neither an input's directory nor hold files prepare-data did
not write. Nothing earlier is replaced in any refusal."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time

import numpy as np
import pytest
from conftest import write_bpe_tokenizer

from trn_accum import cli
from trn_accum.data.datasets import DataError, TokenDataset
from trn_accum.data.prepare import prepare_data
from trn_accum.data.tokens import read_meta

# the suite's JAX has threads; the encoders and the writer forked here run no JAX
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
OUTPUT = ("tokens.bin", "offsets.npy", "meta.json")
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do".split()


def _files(d) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def _bpe(path) -> str:
    """A small byte-level BPE tokenizer.json: slow enough per byte to keep a writer busy."""
    return write_bpe_tokenizer(path, [" ".join(WORDS)] * 20)


def _slow_writer(src: str, out: str, tokenizer: str) -> None:
    prepare_data([src], out, tokenizer, workers=1, chunk_bytes=1 << 14)


def test_a_second_run_into_a_busy_out_is_refused_naming_the_holder(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text((" ".join(WORDS) + "\n") * 40_000)
    tok = _bpe(tmp_path / "tokenizer.json")
    small = tmp_path / "small.txt"
    small.write_text("another corpus, written while the first run is on\n")
    out = tmp_path / "tok"
    writer = multiprocessing.get_context("fork").Process(
        target=_slow_writer, args=(str(big), str(out), tok)
    )
    writer.start()
    deadline = time.monotonic() + 60
    while not list(out.glob("tokens.bin.tmp*")):  # the writer is encoding
        assert time.monotonic() < deadline and writer.is_alive()
        time.sleep(0.01)
    code = cli.main(["prepare-data", str(small), "--out", str(out), "--workers", "1"])
    assert writer.is_alive()  # the refusal came while the first run held --out
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    assert (
        f"--out {out} is being written by another prepare-data (pid {writer.pid} on host"
        in (err[0])
    )
    writer.join(120)
    assert writer.exitcode == 0
    assert sorted(os.listdir(out)) == sorted(OUTPUT)  # no temporary or lock file left
    meta = read_meta(str(out))
    assert meta["sources"] == [str(big)]  # the first run's output, whole, and it loads
    assert TokenDataset(str(out), seq_len=8, batch_size=2).num_train_windows > 0
    # once it is done, the next run may write (and replaces the output as a whole)
    assert cli.main(["prepare-data", str(small), "--out", str(out), "--workers", "1"]) == 0
    assert read_meta(str(out))["sources"] == [str(small)]


def test_files_the_meta_does_not_vouch_for_are_refused_by_the_loader(tmp_path):
    for name, word in (("a", "alpha"), ("b", "bravo")):  # same sizes, other content
        (tmp_path / f"{name}.txt").write_text(f"{word} " * 3000)
        prepare_data([str(tmp_path / f"{name}.txt")], str(tmp_path / name), workers=1)
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "tokens.bin").stat().st_size == (b / "tokens.bin").stat().st_size
    mixed = shutil.copytree(a, tmp_path / "mixed")
    shutil.copyfile(b / "tokens.bin", mixed / "tokens.bin")  # run b's tokens under a's meta
    with pytest.raises(DataError) as e:
        TokenDataset(str(mixed), seq_len=8, batch_size=2)
    assert str(e.value) == (
        f"token data file {mixed / 'tokens.bin'} is not the one {mixed / 'meta.json'} was "
        f"written with (its sampled digest differs: changed, or written by another run): "
        f"re-run `trn-accum prepare-data`"
    )
    raw = bytearray((a / "tokens.bin").read_bytes())
    raw[len(raw) // 2] ^= 1  # one byte changed in place: same size
    (mixed / "tokens.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="tokens.bin is not the one"):
        read_meta(str(mixed))
    shutil.copyfile(a / "tokens.bin", mixed / "tokens.bin")
    offsets = np.load(a / "offsets.npy")
    offsets[1] += 1
    np.save(mixed / "offsets.npy", offsets)
    with pytest.raises(DataError, match="offsets.npy is not the one"):
        read_meta(str(mixed))
    assert read_meta(str(a))["num_tokens"] == 6 * 3000 + 1  # the untouched one loads


def test_out_may_not_be_an_input_directory_nor_hold_foreign_files(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the corpus itself\n")
    (corpus / "meta.json").write_text('{"name": "my dataset", "license": "cc-by"}')
    (corpus / "tokens.bin").write_bytes(b"the user's own file")
    before = _files(corpus)
    assert cli.main(["prepare-data", str(corpus / "a.txt"), "--out", str(corpus)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"--out {corpus} is the directory of the input" in err[0], err
    assert _files(corpus) == before
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    (other / "notes.txt").write_text("mine")
    assert cli.main(["prepare-data", str(corpus / "a.txt"), "--out", str(other)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and (
        f"--out {other} holds files prepare-data did not write (a.txt, meta.json, notes.txt)"
        in err[0]
    )
    assert _files(other) == {**before, "notes.txt": b"mine"}
    # a directory prepare-data wrote is rewritten whole
    mine = tmp_path / "mine"
    assert cli.main(["prepare-data", str(corpus / "a.txt"), "--out", str(mine)]) == 0
    assert cli.main(["prepare-data", str(corpus / "a.txt"), "--out", str(mine)]) == 0
    assert sorted(os.listdir(mine)) == sorted(OUTPUT)
