"""prepare-data stops cleanly: on a full disk (a real tmpfs) with 2 workers it exits in one
line, the earlier output byte-identical and no temporary file left, never hanging; it forks no
more workers than there are tasks; a real SIGINT stops it once at any moment, also one that
lands in a garbage-collector callback (where Python swallows a KeyboardInterrupt, as with
JAX's), and the earlier output stays as it was."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import subprocess_env, write_bpe_tokenizer
from tmpfs import small_tmpfs

from trn_accum.data.prepare import prepare_data
from trn_accum.data.tokens import read_meta

# the suite's JAX has threads; the processes forked here run no JAX
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
OUTPUT = ["meta.json", "offsets.npy", "tokens.bin"]
LINE = b"lorem ipsum dolor sit amet consectetur adipiscing elit sed do\n"


def _snapshot(out) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out))}


def _in_child(target, *args, timeout: float = 90) -> int:
    """Exit code of `target(*args)` run in a forked process; fails (after killing it) if it
    does not end within `timeout` seconds: a hang."""
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{target.__name__} did not end within {timeout} s: it hangs")
    return child.exitcode


def _prepare_exit(src: str, out: str, workers: int) -> None:
    try:
        prepare_data([src], out, workers=workers, chunk_bytes=1 << 16)
    except Exception as e:
        print(e, file=sys.stderr)
        os._exit(3 if "No space left on device" in str(e) else 4)
    os._exit(0)


def test_a_full_disk_with_two_workers_is_one_line_and_loses_nothing(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(LINE * 200_000)  # 12.6 MB of text: 25 MB of uint16 tokens
    small = tmp_path / "small.txt"
    small.write_bytes(b"an earlier, complete preparation\n")
    with small_tmpfs(tmp_path / "mnt", 3_000_000) as mnt:
        out = mnt / "tok"
        prepare_data([str(small)], str(out), workers=1)
        before = _snapshot(out)
        for _ in range(4):  # it hung in 3 of 4 runs
            assert _in_child(_prepare_exit, str(big), str(out), 2) == 3
            assert _snapshot(out) == before  # earlier output intact, no temp or lock file
        assert read_meta(str(out))["sources"] == [str(small)]


def _count_forks(files: list[str], out: str, workers: int) -> None:
    forks = [0]
    os.register_at_fork(after_in_parent=lambda: forks.__setitem__(0, forks[0] + 1))
    prepare_data(files, out, workers=workers, chunk_bytes=1024)
    os._exit(forks[0])


def test_workers_are_capped_by_the_work(tmp_path):
    files = []
    for i in range(5):  # one task a file
        (tmp_path / f"f{i}.txt").write_bytes(LINE * 20)
        files.append(str(tmp_path / f"f{i}.txt"))
    assert _in_child(_count_forks, files, str(tmp_path / "o"), 64) == 5
    assert read_meta(str(tmp_path / "o"))["num_documents"] == 5
    assert _in_child(_count_forks, files[:1], str(tmp_path / "one"), 64) == 0  # in process


def _swallowing_gc_then_prepare(src: str, out: str, started: str) -> None:
    """prepare_data with a gc callback that holds most of the time (as JAX's may), so that a
    SIGINT lands in it and Python swallows the KeyboardInterrupt raised there."""
    gc.set_threshold(1)  # a collection every few allocations: most time is in the callback
    gc.callbacks.append(lambda phase, info: time.sleep(0.002) if phase == "start" else None)
    open(started, "w").close()
    try:
        prepare_data([src], out, workers=1, chunk_bytes=1 << 12)
    except KeyboardInterrupt:
        os._exit(130)
    os._exit(0)


def test_a_sigint_swallowed_by_a_gc_callback_still_stops_the_run(tmp_path):
    src = tmp_path / "big.txt"
    src.write_bytes(LINE * 100_000)
    out = tmp_path / "tok"
    (tmp_path / "small.txt").write_bytes(b"an earlier, complete preparation\n")
    prepare_data([str(tmp_path / "small.txt")], str(out), workers=1)
    before = _snapshot(out)
    started = tmp_path / "started"
    child = multiprocessing.get_context("fork").Process(
        target=_swallowing_gc_then_prepare, args=(str(src), str(out), str(started))
    )
    child.start()
    deadline = time.monotonic() + 30
    while not list(out.glob("tokens.bin.tmp*")):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGINT)
    child.join(60)
    assert not child.is_alive()
    assert child.exitcode == 130  # stopped, not finished
    assert _snapshot(out) == before


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    """A small byte-level BPE tokenizer.json: a few MB take it seconds."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    write_bpe_tokenizer(path, [LINE.decode()] * 20)
    return str(path)


@pytest.mark.parametrize("delays", [(0.0,), (0.2,), (1.0,), (0.5, 0.52)])
def test_ctrl_c_at_any_moment_stops_the_cli_once(tmp_path, bpe, delays):
    """SIGINT at `delays` seconds after the run began writing (the last pair: a double
    Ctrl-C)."""
    src = tmp_path / "big.txt"
    src.write_bytes(LINE * 200_000)  # 12.6 MB: many seconds of BPE on two workers
    out = tmp_path / "tok"
    (tmp_path / "small.txt").write_bytes(b"an earlier, complete preparation\n")
    prepare_data([str(tmp_path / "small.txt")], str(out), workers=1)
    before = _snapshot(out)
    cmd = [sys.executable, "-m", "trn_accum.cli", "prepare-data", str(src), "--out", str(out)]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2", "--tokenizer", bpe],
        env=subprocess_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(out.glob("tokens.bin.tmp*")):  # the run is encoding
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.002)
    start = time.monotonic()
    for delay in delays:
        time.sleep(max(0.0, start + delay - time.monotonic()))
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("prepare-data did not stop within 60 s of a SIGINT")
    assert proc.returncode == 130, err  # interrupted, never finished
    assert err.splitlines() == ["trn-accum: interrupted"], err
    assert _snapshot(out) == before
