"""Issue 48, a cluster: the trainer reads the shard directories of `prepare-data --shard I/N` as
one corpus (`data.path` a glob or a list): the same token stream, document boundaries and
batches as one unsharded prepare-data; a set's identity covers its shards in order, so a
resumed run over another set is refused; shards that do not make one corpus are one line."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from trn_accum import cli
from trn_accum.config import drift
from trn_accum.config.load import Config, ConfigError, config_to_dict, load_config
from trn_accum.data.datasets import DataError, TokenDataset, make_dataset
from trn_accum.data.prepare import prepare_data
from trn_accum.data.token_corpus import TokenCorpus
from trn_accum.data.tokens import fingerprint, read_meta, sampled_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
SHARDS = 3


def write_corpus(d: Path, files: int = SHARDS, docs: int = 20) -> list[str]:
    """`files` JSONL files of about the same size (one per shard), `docs` documents each."""
    rng = random.Random(0)
    out = []
    for i in range(files):
        path = d / f"part-{i}.jsonl"
        lines = [" ".join(rng.choices("ab cd ef gh ij é".split(), k=rng.randint(3, 30)))]
        lines += [
            " ".join(rng.choices("kl mn op".split(), k=rng.randint(3, 30))) for _ in range(docs)
        ]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        out.append(str(path))
    return out


def shard_tokens(shard_dirs: list[Path]) -> bytes:
    """The shards' tokens.bin, concatenated in order."""
    return b"".join((d / "tokens.bin").read_bytes() for d in shard_dirs)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(folder, whole, [shard dirs]): one unsharded prepare and 3 shards of the same files."""
    d = tmp_path_factory.mktemp("shards")
    files = write_corpus(d)
    prepare_data(files, str(d / "whole"), workers=1)
    shards = [d / "tok" / f"shard-{i:05d}" for i in range(SHARDS)]
    for i, out in enumerate(shards):
        prepare_data(files, str(out), workers=1, shard=(i, SHARDS))
        assert read_meta(str(out))["sources"] == [files[i]]  # one file a shard
    return d, d / "whole", shards


def vouch(d: Path) -> None:
    """meta.json re-stamped for the tokens.bin changed in place (the loader refuses a file its
    sidecar does not vouch for)."""
    meta = json.loads((d / "meta.json").read_text())
    meta["sample_blake2b"]["tokens"] = sampled_digest(str(d / "tokens.bin")).hex()
    (d / "meta.json").write_text(json.dumps(meta))


def _dataset(path, **kw):
    return TokenDataset(path, seq_len=16, batch_size=4, eval_fraction=0.1, seed=3, **kw)


def test_a_glob_of_shards_reads_as_the_unsharded_corpus(prepared):
    d, whole_dir, shards = prepared
    whole, sharded = _dataset(str(whole_dir)), _dataset(str(d / "tok" / "shard-*"))
    assert sharded.tokens.dirs == [str(s) for s in shards]  # sorted
    assert shard_tokens(shards) == (whole_dir / "tokens.bin").read_bytes()
    offsets = whole.tokens.offsets
    assert np.array_equal(sharded.tokens.offsets, offsets)
    stream = np.concatenate(  # every document read back through the shards' own files
        [sharded.tokens.read(a, b - a) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    )
    assert stream.tobytes() == (whole_dir / "tokens.bin").read_bytes()
    for key in ("num_tokens", "num_documents", "max_token_id", "vocab_size", "dtype", "eos_id"):
        assert sharded.meta[key] == whole.meta[key], key
    assert (sharded.num_train_windows, sharded.num_eval_windows) == (
        whole.num_train_windows,
        whole.num_eval_windows,
    )
    rows = np.arange(4)
    steps = range(0, 2 * whole.num_train_windows // 4 + 2, 7)  # past the first epoch
    for split in ("train", "eval"):
        for s in steps:
            got, want = sharded.rows(s, rows, split), whole.rows(s, rows, split)
            assert all(np.array_equal(got[k], want[k]) for k in want), (split, s)
    # a list names the same set; a set of one directory is that directory, fingerprint and all
    listed = _dataset([str(shards[0]), str(d / "tok" / "shard-0000[12]")])
    assert listed.fingerprint == sharded.fingerprint
    assert _dataset([str(whole_dir)]).fingerprint == fingerprint(read_meta(str(whole_dir)))


def test_some_parts_of_a_sharded_run_are_refused(prepared, tmp_path):
    """A glob that matched the parts finished so far (the rest of the array still running)
    names what is missing; a part listed twice (a copy) is refused too."""
    d, _, shards = prepared
    with pytest.raises(DataError) as e:
        TokenCorpus(str(d / "tok" / "shard-0000[02]"))
    assert "holds parts 0/3, 2/3 of a `prepare-data --shard I/3` run but not 1/3" in str(e.value)
    with pytest.raises(DataError, match="holds parts 1/3 .* but not 0/3, 2/3"):
        TokenCorpus(str(shards[1]))
    copy = shutil.copytree(shards[2], tmp_path / "again")
    with pytest.raises(DataError, match=re.escape(f"{copy} and {shards[2]} are both part 2/3")):
        TokenCorpus([*map(str, shards), str(copy)])


def test_another_set_of_shards_is_refused_on_resume(prepared, tmp_path):
    d, whole_dir, shards = prepared
    s0, s1, s2 = map(str, shards)
    prints = {
        "all": TokenCorpus(str(d / "tok" / "shard-*")).fingerprint,
        "whole": TokenCorpus(str(whole_dir)).fingerprint,
        "reordered": TokenCorpus([s1, s0, s2]).fingerprint,
    }
    changed = tmp_path / "tok"
    shutil.copytree(d / "tok", changed)
    raw = bytearray((changed / "shard-00001" / "tokens.bin").read_bytes())
    raw[5] ^= 1  # shard 1 re-prepared from other text: its sidecar alone unchanged
    (changed / "shard-00001" / "tokens.bin").write_bytes(bytes(raw))
    vouch(changed / "shard-00001")  # as the run that wrote it would have
    prints["changed"] = TokenCorpus(str(changed / "shard-*")).fingerprint
    assert len(set(prints.values())) == len(prints), prints
    assert (
        prints["all"]
        == TokenCorpus(str(shutil.copytree(d / "tok", tmp_path / "copy") / "shard-*")).fingerprint
    )

    base = config_to_dict(Config())
    base["data"].update(kind="tokens", path=str(d / "tok" / "shard-*"))
    defaults = drift.run_record(config_to_dict(Config()), None)
    old = json.loads(json.dumps(drift.run_record(base, prints["all"])))  # as read back
    assert drift.trajectory_changes(old, drift.run_record(base, prints["all"]), defaults) == {}
    changes = drift.trajectory_changes(old, drift.run_record(base, prints["changed"]), defaults)
    assert changes == {"data.fingerprint": (prints["all"], prints["changed"])}
    with pytest.raises(drift.ConfigDriftError, match="data.fingerprint .* --allow-config-change"):
        drift.check_drift(changes, set(), run_dir="run", step=2, record="checkpoint 2")


def test_shards_that_do_not_make_one_corpus_are_one_line(prepared, tmp_path):
    d, _, shards = prepared
    tok = shutil.copytree(d / "tok", tmp_path / "tok")
    meta_path = tok / "shard-00002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "vocab_size": 300}))
    with pytest.raises(DataError) as e:
        TokenCorpus(str(tok / "shard-*"))
    assert str(e.value) == (
        f"token data shard {tok / 'shard-00002'} has vocab_size = 300 but {tok / 'shard-00000'} "
        f"has 257: the shards of one corpus must share a tokenizer; re-run `trn-accum "
        f"prepare-data` for {tok / 'shard-00002'} with the others' --tokenizer, or leave it out "
        f"of data.path"
    )
    meta_path.write_text(json.dumps(meta))
    (tok / "shard-00003").mkdir()  # a shard still being prepared: no meta.json yet
    (tok / "shard-00003" / "tokens.bin.tmp").write_bytes(b"\0\0")
    with pytest.raises(DataError, match=r"shard-00003/meta.json does not exist"):
        TokenCorpus(str(tok / "shard-*"))
    with pytest.raises(DataError, match=r"glob '.*/nope-\*' matches no directory"):
        TokenCorpus(str(tok / "nope-*"))
    with pytest.raises(DataError, match="names the token directory .*shard-00000 twice"):
        TokenCorpus([str(shards[0]), str(shards[1]), str(shards[0]) + "/meta.json"])
    with pytest.raises(DataError, match="data.path is an empty list"):
        TokenCorpus([])
    with pytest.raises(DataError, match="data vocab_size=257 .* larger than the model's"):
        make_dataset(
            "tokens", path=str(d / "tok" / "shard-*"), seq_len=4, batch_size=2, vocab_size=200
        )


def test_data_path_is_a_glob_or_a_list_in_the_config(tmp_path, capsys):
    tokens = 'data.kind="tokens"'
    assert load_config(TINY, [tokens, "data.path=out/shard-*"]).data.path == "out/shard-*"
    cfg = load_config(TINY, [tokens, 'data.path=["out/a", "out/b"]'])
    assert cfg.data.path == ["out/a", "out/b"]
    record = json.loads(json.dumps(config_to_dict(cfg)))  # the run record, as read back
    assert drift.trajectory_changes(record, config_to_dict(cfg), config_to_dict(Config())) == {}
    toml = tmp_path / "mine.toml"
    toml.write_text(
        f'extends = "{TINY}"\n[data]\nkind = "tokens"\npath = ["x/shard-0", "x/shard-1"]\n'
    )
    assert load_config(toml).data.path == ["x/shard-0", "x/shard-1"]
    for bad in ("[1, 2]", "[]", '["a", ""]'):
        with pytest.raises(ConfigError) as e:
            load_config(TINY, [tokens, f"data.path={bad}"])
        assert "must be a directory or glob, or a non-empty list of them" in str(e.value)
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run-dir", str(run), "--set", tokens]
    assert cli.main([*args, "--set", f"data.path={tmp_path}/shard-*"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "/shard-*' matches no directory" in err[0], err
