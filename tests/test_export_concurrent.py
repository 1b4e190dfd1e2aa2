"""Two exports into one OUT_DIR at once (real processes): neither removes the other's
temporary directory, both complete, and OUT_DIR is one of the two exports, whole. A killed
export's temporary directory (its process gone, so its lock too) is removed by the next."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from conftest import subprocess_env

from trn_accum.interop import hf_io

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}

# An export whose first tensor waits: it prints its temporary directory, then reads a line
# of stdin (the parent's go-ahead) before the shard is written.
WRITER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from trn_accum.interop import hf_io

    out, seed = sys.argv[1], int(sys.argv[2])
    values = {f"t{i}": np.full((4, 4), seed + i, np.float32) for i in range(3)}

    def tensor(name):
        if name == "t0":
            parent, base = os.path.split(os.path.abspath(out))
            mine = [n for n in os.listdir(parent) if n.startswith(f".{base}.tmp-")]
            print(json.dumps(mine), flush=True)
            sys.stdin.readline()
        return values[name]

    sizes = {n: v.nbytes for n, v in values.items()}
    written = hf_io.write_checkpoint(out, {"model_type": "llama"}, sizes, tensor)
    print("done", ",".join(written), flush=True)
    """
)


def writer(out: Path, seed: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), str(seed)],
        env=subprocess_env(),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def tensors(seed: int) -> dict[str, np.ndarray]:
    return {f"t{i}": np.full((4, 4), seed + i, np.float32) for i in range(3)}


def export(out: Path, seed: int) -> list[str]:
    values = tensors(seed)
    sizes = {n: v.nbytes for n, v in values.items()}
    return hf_io.write_checkpoint(str(out), CONFIG, sizes, values.__getitem__)


def stored(out: Path) -> np.ndarray:
    files = hf_io.tensor_files(str(out))
    return hf_io.read_tensor(files, "t0")


def hidden(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out.parent) if n.startswith(f".{out.name}.tmp-"))


def test_a_live_exports_temporary_directory_is_not_removed(tmp_path):
    out = tmp_path / "exported"
    export(out, 0)  # an earlier export, replaced by both
    first = writer(out, 100)
    try:
        live = json.loads(first.stdout.readline())  # the first export waits, mid-write
        assert len(live) == 1, live
        export(out, 200)  # the second export runs to its end meanwhile
        assert (tmp_path / live[0]).is_dir(), "the live export's directory was removed"
        np.testing.assert_array_equal(stored(out), tensors(200)["t0"])
        out_text, err = first.communicate("go\n", timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err[-3000:]
    assert out_text.startswith("done model.safetensors,config.json"), out_text
    np.testing.assert_array_equal(stored(out), tensors(100)["t0"])  # the later swap wins
    assert hidden(out) == []


def test_a_killed_exports_temporary_directory_is_removed_by_the_next(tmp_path):
    out = tmp_path / "exported"
    killed = writer(out, 100)
    try:
        left = json.loads(killed.stdout.readline())
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
    assert hidden(out) == left and len(left) == 1  # what a kill leaves
    export(out, 300)
    assert hidden(out) == []
    np.testing.assert_array_equal(stored(out), tensors(300)["t0"])
