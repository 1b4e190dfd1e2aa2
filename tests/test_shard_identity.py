"""A shard set is one corpus only if its parts share a tokenizer, by the digest of its
tokenizer.json (two tokenizers of one vocabulary size and end-of-text id differ); a glob's
parts are read in the order of their recorded `--shard` index, not of their names."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_bpe_tokenizer
from tokenizers import Tokenizer

from trn_accum.data import token_corpus
from trn_accum.data.datasets import DataError
from trn_accum.data.prepare import prepare_data
from trn_accum.data.token_corpus import TokenCorpus
from trn_accum.data.tokens import read_meta


def _jsonl(path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def test_parts_prepared_with_two_tokenizers_of_one_size_are_refused(tmp_path):
    a = write_bpe_tokenizer(
        tmp_path / "a.json", ["the quick brown fox jumps over the lazy dog"] * 30
    )
    spec = json.loads(open(a).read())  # b: a with the ids of two tokens swapped
    vocab = spec["model"]["vocab"]
    vocab["q"], vocab["z"] = vocab["z"], vocab["q"]
    b = str(tmp_path / "b.json")
    open(b, "w").write(json.dumps(spec))
    ta, tb = Tokenizer.from_file(a), Tokenizer.from_file(b)
    assert ta.get_vocab_size() == tb.get_vocab_size()
    assert ta.token_to_id("<|endoftext|>") == tb.token_to_id("<|endoftext|>") == 0
    assert ta.encode("quiz").ids != tb.encode("quiz").ids
    files = [_jsonl(tmp_path / f"f{i}.jsonl", [f"the quick fox {i}"] * 5) for i in range(2)]
    out = tmp_path / "tok"
    prepare_data(files, str(out / "shard-0"), a, workers=1, shard=(0, 2))
    prepare_data(files, str(out / "shard-1"), b, workers=1, shard=(1, 2))
    digests = [read_meta(str(out / f"shard-{i}"))["tokenizer_digest"] for i in range(2)]
    assert digests[0] != digests[1] and all(d.startswith("blake2b:") for d in digests)
    with pytest.raises(DataError) as e:
        TokenCorpus(str(out / "shard-*"))
    assert str(e.value).startswith(
        f"token data shard {out / 'shard-1'} has tokenizer_digest = {digests[1]!r} but "
        f"{out / 'shard-0'} has {digests[0]!r}: the shards of one corpus must share a tokenizer"
    )
    prepare_data(files, str(out / "shard-1"), a, workers=1, shard=(1, 2))  # same tokenizer
    assert TokenCorpus(str(out / "shard-*")).meta["num_documents"] == 10


def test_parts_are_read_in_the_order_of_their_index(tmp_path):
    files = [
        _jsonl(tmp_path / f"f{i:02d}.jsonl", [f"document {i}.{j}" for j in range(3)])
        for i in range(11)
    ]
    prepare_data(files, str(tmp_path / "whole"), workers=1)
    for i in range(11):
        prepare_data(files, str(tmp_path / "tok" / f"part-{i}"), workers=1, shard=(i, 11))
    corpus = TokenCorpus(str(tmp_path / "tok" / "part-*"))
    assert corpus.dirs == [str(tmp_path / "tok" / f"part-{i}") for i in range(11)]
    whole = np.fromfile(tmp_path / "whole" / "tokens.bin", np.uint16)
    stream = np.concatenate(
        [
            corpus.read(int(s), int(e - s))
            for s, e in zip(corpus.offsets[:-1], corpus.offsets[1:], strict=True)
        ]
    )
    assert stream.tobytes() == whole.tobytes()
    # other directories keep their place; the parts of a run sit where its first one is
    names = ["a", "part-0", "part-1", "part-10", "part-2", "z"]
    paths = [str(tmp_path / "tok" / n) for n in names]
    (tmp_path / "tok" / "a").mkdir()
    (tmp_path / "tok" / "z").mkdir()
    assert [p.rsplit("/", 1)[1] for p in token_corpus.by_part(paths)] == [
        "a",
        "part-0",
        "part-1",
        "part-2",
        "part-10",
        "z",
    ]
