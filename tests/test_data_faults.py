"""The data a run trains on, held to account from outside: data re-prepared under a run (its
fingerprint refused on resume, accepted with --allow-config-change data and recorded), token ids
beyond the model's vocabulary (the step, the row and the id; the committed checkpoints still
restore), a token file that shrinks under the reader, and unreadable files and directories
(permissions enforced by dropping root's DAC override, so the test means the same as root)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env, user_error_line

from trn_accum.data.datasets import DataError, TokenDataset
from trn_accum.data.prepare import prepare_data
from trn_accum.data.tokens import fingerprint, read_meta, sampled_digest
from trn_accum.errors import EXIT_USAGE
from trn_accum.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "fuji-tiny.toml")
# Root's DAC override dropped: owner permission bits apply to root-owned files (no-op as non-root).
NO_DAC = (
    ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
     "--inh-caps=-dac_override,-dac_read_search"]
    if os.geteuid() == 0 else []
)  # fmt: skip


def _prepare(out, text: str, docs: int = 6):
    src = out.parent / f"{out.name}-src"
    src.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(docs):
        f = src / f"d{i}.txt"
        f.write_text(f"{text} {i} " * 400)  # ~75 windows of 65 tokens each
        files.append(str(f))
    return prepare_data(files, str(out))


def vouch(data) -> None:
    """meta.json re-stamped for the tokens.bin changed in place, as a writer of those bytes
    would stamp it (the loader refuses a file its sidecar does not vouch for)."""
    meta = json.loads((data / "meta.json").read_text())
    meta["sample_blake2b"]["tokens"] = sampled_digest(str(data / "tokens.bin")).hex()
    (data / "meta.json").write_text(json.dumps(meta))


def _train(run, data, *sets, allow=(), prefix=(), fault=None, env=None):
    cli = ["-m", "trn_accum.cli"] if fault is None else [str(ROOT / "tests" / "fault_driver.py"),
                                                         fault, "--"]  # fmt: skip
    args = [*prefix, sys.executable, *cli, "train", "--config", TINY,
            "--run-dir", str(run), "--set", 'data.kind="tokens"', "--set", f'data.path="{data}"',
            "--set", "checkpoint.every=1", "--set", "trainer.log_every=1"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    if allow:
        args += ["--allow-config-change", *allow]
    return subprocess.run(
        args, env=subprocess_env(**(env or {})), cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def _steps(run):
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def test_fingerprint_changes_with_the_content_not_the_source_paths(tmp_path):
    _prepare(tmp_path / "a", "alpha")
    a = read_meta(str(tmp_path / "a"))
    b_dir = tmp_path / "b"
    shutil.copytree(tmp_path / "a", b_dir)
    b = read_meta(str(b_dir))
    assert fingerprint(a) == fingerprint(b)  # same bytes elsewhere: the same data
    meta = json.loads((b_dir / "meta.json").read_text())
    meta["sources"] = ["/elsewhere.txt"]
    (b_dir / "meta.json").write_text(json.dumps(meta))
    assert fingerprint(read_meta(str(b_dir))) == fingerprint(a)
    tokens = b_dir / "tokens.bin"
    raw = bytearray(tokens.read_bytes())
    raw[10] ^= 1  # one byte of content, sidecar untouched (small file: hashed whole)
    tokens.write_bytes(bytes(raw))
    vouch(b_dir)
    assert fingerprint(read_meta(str(b_dir))) != fingerprint(a)
    assert len(a["tokens_blake2b"]) == 32


@pytest.mark.slow
def test_data_reprepared_under_a_run_is_refused_then_allowed_and_recorded(tmp_path):
    data, run = tmp_path / "tok", tmp_path / "run"
    _prepare(data, "the first corpus")
    r = _train(run, data, "trainer.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    before = json.loads((run / "config.json").read_text())["data"]["fingerprint"]
    assert before == fingerprint(read_meta(str(data)))
    shutil.rmtree(data)
    _prepare(data, "another corpus entirely")
    r = _train(run, data, "trainer.steps=3")
    line = user_error_line(r, EXIT_USAGE, "data.fingerprint", before, "--allow-config-change")
    assert "would change its trajectory" in line
    assert _steps(run) == [1, 2]  # nothing written, nothing lost
    r = _train(run, data, "trainer.steps=3", allow=("data",))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / '2'} (step 2)" in r.stdout
    rows = [json.loads(ln) for ln in (run / "config_changes.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2
    change = rows[-1]["changes"]["data.fingerprint"]
    assert change["old"] == before and change["new"] == fingerprint(read_meta(str(data)))
    assert [m["step"] for m in read_metrics(run) if m["kind"] == "train"] == [1, 2, 3]


def _window_position(ds, step: int, row: int) -> int:
    """A token position only the window of (step, row) covers (its middle)."""
    w = int(ds.window_ids(step, np.asarray([row]))[0])
    start, length = ds._train[0][w], ds._train[1][w]
    return int(start + length // 2)


def test_out_of_range_id_names_the_step_row_and_id(tmp_path):
    data = tmp_path / "tok"
    _prepare(data, "some text")
    ds = TokenDataset(str(data), seq_len=64, batch_size=32, model_vocab=512)
    pos = _window_position(ds, 4, 17)
    tokens = np.memmap(data / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[pos] = 600  # the sidecar still claims vocab 257, max id 256
    tokens.flush()
    del tokens
    vouch(data)
    ds = TokenDataset(str(data), seq_len=64, batch_size=32, model_vocab=512)
    for s in range(4):
        ds.rows(s, np.arange(32))  # the steps before it are clean
    with pytest.raises(DataError, match=r"token id 600 in train step 5, row 17, position \d+ "):
        ds.rows(4, np.arange(32))
    ds.rows(4, np.arange(16))  # another host's rows of the same step hold no bad id


@pytest.mark.slow
def test_out_of_range_id_stops_the_run_in_one_line_and_keeps_its_checkpoints(tmp_path):
    data, run = tmp_path / "tok", tmp_path / "run"
    _prepare(data, "some text")
    good = (data / "tokens.bin").read_bytes()
    ds = TokenDataset(str(data), seq_len=64, batch_size=32, model_vocab=512)
    pos = _window_position(ds, 2, 5)
    tokens = np.memmap(data / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[pos] = 999
    tokens.flush()
    del tokens
    vouch(data)
    r = _train(run, data, "trainer.steps=5")
    user_error_line(r, EXIT_USAGE, "token id 999 in train step 3, row 5", "vocab_size=512")
    assert _steps(run) == [1, 2]
    assert not (run / "owner.json").exists()  # the claim released
    (data / "tokens.bin").write_bytes(good)  # repaired: other content, so allowed explicitly
    vouch(data)
    r = _train(run, data, "trainer.steps=3", allow=("data.fingerprint",))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / '2'} (step 2)" in r.stdout


@pytest.mark.slow
def test_token_file_cut_under_a_running_trainer_is_one_line_and_loses_nothing(tmp_path):
    """tokens.bin cut to a third after step 2 is logged (step 3's batch is already built): the
    batch of step 4 is a short read; step 3 is saved, one line, exit 2, the claim released, no
    partial step directory; with the file restored the run resumes from step 3."""
    data, run = tmp_path / "tok", tmp_path / "run"
    _prepare(data, "text")
    good = (data / "tokens.bin").read_bytes()
    r = _train(run, data, "trainer.steps=6", fault="truncate_after_step=2",
               env={"FAULT_TRUNCATE": str(data / "tokens.bin")})  # fmt: skip
    user_error_line(r, EXIT_USAGE, "shrank under the trainer", f"{len(good)} bytes at start")
    assert not (run / "owner.json").exists()
    # step 3 committed (checkpoint.keep = 2 of the tiny config), no partial step directory
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]
    (data / "tokens.bin").write_bytes(good)
    r = _train(run, data, "trainer.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / '3'} (step 3)" in r.stdout


def test_token_file_that_shrinks_under_the_reader_is_one_line(tmp_path):
    data = tmp_path / "tok"
    _prepare(data, "text")
    ds = TokenDataset(str(data), seq_len=64, batch_size=32, model_vocab=512)
    ds.rows(0, np.arange(32))
    size = (data / "tokens.bin").stat().st_size
    os.truncate(data / "tokens.bin", size // 3)
    with pytest.raises(DataError, match=f"shrank under the trainer: it had {size} bytes at start, "
                                        f"{size // 3} now"):  # fmt: skip
        for s in range(1, 50):
            ds.rows(s, np.arange(32))


@pytest.mark.parametrize("target, needle", [("tokens.bin", "token data file"), (".", "directory")])
def test_unreadable_data_is_a_permission_error_in_one_line(tmp_path, target, needle):
    data = tmp_path / "tok"
    _prepare(data, "text")
    path = (data / target).resolve()
    os.chmod(path, 0)
    try:
        r = _train(tmp_path / "run", data, "trainer.steps=1", prefix=NO_DAC)
    finally:
        os.chmod(path, 0o755)
    user_error_line(r, EXIT_USAGE, f"{needle} {path} is not readable", "permission denied")
    assert not (tmp_path / "run" / "checkpoints").exists() or _steps(tmp_path / "run") == []


def test_two_processes_with_different_sets_name_the_keys_on_every_rank(tmp_path):
    """Rank 1 gets another --set: both ranks stop before building anything with the same one
    line naming the key and both values, exit 2; nothing is written to the run dir."""
    from multiprocess import run_processes

    code = (
        "import os, sys\n"
        "from trn_accum import cli\n"
        "extra = ['--set', 'optimizer.peak_lr=0.5'] if os.environ['TRN_ACCUM_PROCESS_ID'] == '1'"
        " else []\n"
        f"sys.exit(cli.main(['train', '--config', {TINY!r}, '--run-dir', {str(tmp_path / 'r')!r},"
        " '--set', 'trainer.steps=2', *extra]))\n"
    )
    results = run_processes(code, 2, devices_per_process=4, timeout=300, check=False)
    lines = set()
    for r in results:
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == EXIT_USAGE and len(err) == 1, (r.returncode, r.stderr[-3000:])
        lines.add(err[0])
    (line,) = lines  # the same line on both ranks
    assert "the 2 processes of this job do not run one config" in line
    assert "process 1 differs from process 0 in optimizer.peak_lr" in line and "vs 0.5" in line
    assert not (tmp_path / "r" / "checkpoints").exists()
