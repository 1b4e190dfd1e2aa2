"""Test set-up: 8 emulated CPU devices, fixed before JAX is imported anywhere."""

import os

# The suite's programs are tiny and compiled once each: LLVM's optimizations of XLA:CPU's
# generated code cost more than they save. Measured on 2 idle cores (pytest -p no:cacheprovider
# tests/test_accumulation.py tests/test_strategy.py): 60.0 s without the first two flags, 44.6 s
# with them; tests/test_train.py tests/test_gather_once.py: 64.1 s -> 47.8 s. The third has
# XLA:CPU generate the fusions' code with its older LLVM IR emitters, not its MLIR fusion
# emitters (a backend option both jaxlibs of `make test` know): `pytest -p no:xdist
# tests/test_strategy.py tests/test_train.py` 42.2 -> 25.3 s user CPU on jaxlib 0.10.0,
# tests/test_strategy.py 11.7 -> 6.4 s on 0.11.2. None changes the partitioned module (the
# collectives, dtypes and FLOPs the tests read, `trn_accum.analysis.hlo.partitioned`); the third
# changes XLA:CPU's own later passes (a scatter becomes a loop) and its fusions (float32
# rounding may differ between two programs of the same math). Every executable stays
# deterministic. Every process the suite starts gets them (`xla_flags`); a user's run does not.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true"
)


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process the suite starts: the fast-compile flags, then `devices`
    emulated CPU devices (None: the process sets its own count, as the CLI does)."""
    count = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return FAST_COMPILE_FLAGS + count


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " "
    + xla_flags(8)
    # XLA:CPU may deadlock emulated-device collectives without this (see trn_accum.cli).
    + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The trainer fits its lines to $COLUMNS (trn_accum.train.metrics.console_width). pytest-xdist's
# workers inherit a COLUMNS (and LINES) that GNU readline sets in the environment of the process
# that imports it, so every `trn-accum` subprocess would wrap its lines at 80 columns. The suite's
# subprocesses print as to a log file (no width); tests of the width set COLUMNS themselves.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 emulated CPU devices, got {jax.device_count()}"

# ----------------------------------------------------------------------------- compile cache
# The suite compiles the same tiny programs again and again, in its test processes (a fresh
# jit of the fuji-tiny step per test) and in the `trn-accum` / JAX subprocesses it starts: all
# of them share one persistent compilation cache, a folder made per `pytest` run by the process
# that starts the xdist workers (`pytest_configure` below), inherited through the environment.
# Measured on 2 busy cores: the tiny 10-step run, 19.5 s user without, 4.5 s user on a hit.
# Size-capped, so that JAX takes its file lock around every read and write (two workers'
# processes write at once). jaxlib 0.10.0's XLA:CPU logs two error lines per cache hit here
# (openxla/xla#44565: tuning flags in the host-feature check; the executable loads and runs),
# hence TF_CPP_MIN_LOG_LEVEL. What reads XLA's dumps turns the cache off for that compile
# itself (trn_accum.analysis.hlo.partitioned), as it must on trn2, where the cache is on.
JAX_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
    "TF_CPP_MIN_LOG_LEVEL": "3",
}
# For a test that needs a real compile (its subprocess must spend the compile's time).
NO_JAX_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def pytest_configure(config):
    """The controller (or the only process) makes the run's cache folder; xdist workers inherit
    it with the environment (they start after this hook, and their JAX reads it at import)."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import tempfile

    config._trn_accum_jax_cache = tempfile.mkdtemp(prefix="trn-accum-jax-cache-")
    os.environ.update(JAX_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=config._trn_accum_jax_cache)
    # this process imported JAX before: without xdist it runs the tests itself
    jax.config.update("jax_compilation_cache_dir", config._trn_accum_jax_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_collection_modifyitems(config, items):
    """Tests marked slow first, otherwise in collection order: xdist hands the tests out in this
    order (after its multi-test xdist groups), so the long ones start while both workers are
    busy and the short ones even out the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
    cache = getattr(config, "_trn_accum_jax_cache", None)
    if cache:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


# ----------------------------------------------------------------------------- shared helpers
# (imported by test files as `from conftest import ...`; pytest puts tests/ on sys.path)

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def assert_close(actual, expected, *, rtol=1e-5, atol=0.0, scaled_atol=False, dtypes=False):
    """Pytrees with the same structure whose leaves are allclose (same shapes; same dtypes too
    with `dtypes`). `scaled_atol`: atol = rtol × max |expected| per leaf, for leaves whose
    entries cancel to near zero."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        jax.tree.structure(actual),
        jax.tree.structure(expected),
    )
    flat, _ = jax.tree_util.tree_flatten_with_path(actual)
    for (path, a), e in zip(flat, jax.tree.leaves(expected), strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        if dtypes:
            assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        tol = rtol * float(np.max(np.abs(e.astype(np.float64)))) if scaled_atol and e.size else atol
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=tol, err_msg=name
        )


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Runs the test under both SPMD partitioners (Shardy is JAX's default)."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", old)


def subprocess_env(devices: int = 8, **extra) -> dict:
    """The environment of a `trn-accum` subprocess in the tests: CPU platform with `devices`
    emulated devices, no launcher variables; the suite's compilation cache comes with
    os.environ (see JAX_CACHE_ENV)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRN_ACCUM_"))}
    env.pop("JOB_COMPLETION_INDEX", None)
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    env.update(extra)
    return env


def user_error_line(r, code: int = 2, *needles: str) -> str:
    """A finished `trn-accum` process failed as a user error should: exit `code`, no traceback,
    exactly one stderr line `trn-accum: error: ...` containing every needle. Returns it."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("trn-accum: error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_cli(*args, timeout: int = 300):
    """`python -m trn_accum.cli ARGS` from the repository root in `subprocess_env()`: the
    finished process (stdout and stderr captured as text)."""
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run(
        [sys.executable, "-m", "trn_accum.cli", *map(str, args)],
        env=subprocess_env(),
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_bpe_tokenizer(path, corpus: list[str], vocab_size: int = 300) -> str:
    """A small byte-level BPE tokenizer.json trained on `corpus` (with "<|endoftext|>"), saved
    at `path` (the `tokenizers` package, as prepare-data reads it). Returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return str(path)
