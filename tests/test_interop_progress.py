"""`import-hf` and `export-hf` show their progress on stderr (`trn_accum.data.progress.Meter`,
prepare-data's bar and lines made general): a first line naming what is read or written and its
size, a line at most every 30 s in a log file (a tqdm bar on a terminal), a last line saying
done; stdout holds each command's own line, unchanged."""

import io

import numpy as np
import pytest
from test_import_refusals import MODEL, TINY, float_tensors, write_checkpoint

from trn_accum import cli
from trn_accum.data.progress import Meter, count_line, size_text
from trn_accum.interop import convert, hf_io
from trn_accum.model import fuji

# fuji-tiny's HF tensors in float32: 20 of them, 525.6 kB
F32_BYTES = 4 * sum(int(np.prod(shape)) for shape in convert.hf_shapes(MODEL).values())


def test_import_then_export_say_what_they_do_on_stderr_only(tmp_path, capsys):
    hf = write_checkpoint(tmp_path / "hf", float_tensors())
    run, out = tmp_path / "run", tmp_path / "out"
    capsys.readouterr()
    assert cli.main(["import-hf", str(hf), "--config", TINY, "--run-dir", str(run)]) == 0
    got = capsys.readouterr()
    assert got.out == (
        f"imported {fuji.num_params(MODEL):,} parameters from {hf} into {run}/checkpoints/0 "
        f"(step 0, fresh optimizer state); train it with: trn-accum train --config {TINY} "
        f"--run-dir {run}\n"
    )
    err = got.err.splitlines()
    first = f"import-hf: reading 20 tensors ({size_text(F32_BYTES)}) from {hf} (1 file)"
    assert err[0] == f"{first} into {run}", err
    assert err[1].startswith(f"import-hf: read 20 tensors ({size_text(F32_BYTES)}) in ")
    assert err[1].endswith(
        f"s; saving step 0 (the parameters and a fresh optimizer state) to {run}/checkpoints/0"
    )
    assert err[-1].startswith("import-hf: done: saved in ") and len(err) == 3, err

    argv = ["export-hf", str(run), str(out), "--dtype", "float32", "--eos-token-id", "2"]
    assert cli.main(argv) == 0
    got = capsys.readouterr()
    assert (
        got.out
        == f"wrote model.safetensors, generation_config.json, config.json (float32) to {out}\n"
    )
    what = f"20 tensors ({size_text(F32_BYTES)}, float32)"
    assert got.err.splitlines()[:2] == [
        f"export-hf: restoring the parameters of the newest checkpoint in {run}",
        f"export-hf: writing {what} of step 0 to {out}",
    ]
    last = got.err.splitlines()[-1]
    assert last.startswith(f"export-hf: done: wrote {what} in ") and len(got.err.splitlines()) == 3


def test_lines_in_a_log_file_at_most_one_per_interval():
    t, stream = [0.0], io.StringIO()
    meter = Meter(
        "export-hf",
        4_000_000,
        stream,
        items=4,
        item="tensors",
        first="writing 4 tensors (4.0 MB) to out",
        interval_s=30,
        clock=lambda: t[0],
    )
    for now in (10, 40, 50, 80):  # lines at 40 and 80 s, none at 10 or 50
        t[0] = now
        meter.update(1_000_000)
    meter.close("done: wrote 4 tensors (4.0 MB) in 80.0 s")
    assert stream.getvalue().splitlines() == [
        "export-hf: writing 4 tensors (4.0 MB) to out",
        "export-hf: 2.0 of 4.0 MB (50%), 2 of 4 tensors, 0.1 MB/s, ETA 0:00:40",
        count_line("export-hf", 4_000_000, 4_000_000, "4 of 4 tensors", 80.0),
        "export-hf: done: wrote 4 tensors (4.0 MB) in 80.0 s",
    ]
    quiet = Meter("import-hf", 10, None, first="reading")  # another process: nothing, no error
    quiet.update(10)
    quiet.close("done")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_between_the_first_and_last_lines():
    pytest.importorskip("tqdm")
    term = _Terminal()
    meter = Meter("import-hf", 4_000_000, term, items=4, item="tensors", first="reading 4 tensors")
    meter.update(1_000_000)
    meter.close("done: read 4 tensors")
    lines = term.getvalue().replace("\r", "\n").splitlines()
    assert (
        lines[0] == "import-hf: reading 4 tensors"
        and lines[-1] == "import-hf: done: read 4 tensors"
    )
    bar = [ln for ln in lines if "25%|" in ln][-1]
    assert bar.startswith("import-hf:  25%|") and "1.00M/4.00M" in bar and "1 of 4 tensors" in bar
    term = _Terminal()
    with pytest.raises(RuntimeError), Meter("export-hf", 10, term) as meter:
        meter.update(5)
        raise RuntimeError  # the bar ends: the error's line starts on a line of its own
    assert term.getvalue().endswith("\n") and meter.bar is None


def test_sizes_for_people():
    assert [size_text(n) for n in (512, 12_345, 1_234_567, 16_060_000_000)] == [
        "512 B",
        "12.3 kB",
        "1.2 MB",
        "16.1 GB",
    ]


def test_a_stored_tensor_counts_its_bytes(tmp_path):
    hf = write_checkpoint(tmp_path / "hf", float_tensors())
    files = hf_io.tensor_files(str(hf))
    sizes = hf_io.stored_bytes(files, sorted(files))
    assert sum(sizes.values()) == F32_BYTES and len(sizes) == 20
