"""Test set-up: 8 emulated CPU devices, fixed before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    # XLA:CPU may deadlock emulated-device collectives without this (see trn_accum.cli).
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"
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
# The suite's `trn-accum` / JAX subprocesses compile the same tiny programs again and again
# (the fuji-tiny train step on 8 or 4 devices, ...): they share one persistent
# compilation cache, a folder made per `pytest` run by the process that starts the xdist
# workers (`pytest_configure` below), inherited through the environment. Measured on 2 busy
# cores: the tiny 10-step run, 19.5 s user without, 4.5 s user on a hit. Size-capped, so that
# JAX takes its file lock around every read and write (two workers' processes write at once).
# jaxlib 0.10.0's XLA:CPU logs two error lines per cache hit here (openxla/xla#44565: tuning
# flags in the host-feature check; the executable loads and runs), hence TF_CPP_MIN_LOG_LEVEL.
# The test processes themselves compile without it (their own programs; tests read compiled
# executables, and a loaded one lacks its source-location table).
JAX_CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
    "TF_CPP_MIN_LOG_LEVEL": "3",
}
jax.config.update("jax_compilation_cache_dir", None)
# For a subprocess that reads XLA's dumps (`trn-accum dry-run`, `neuron-check`: the module after
# SPMD partitioning, trn_accum.analysis.partitioned): a cache hit compiles nothing, dumps
# nothing, and that analysis fails ("XLA dumped no module after pass ..."), as the reference
# dry-run test did in a full run with the cache. Also for a test that needs a real compile.
NO_JAX_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def pytest_configure(config):
    """The controller (or the only process) makes the run's cache folder; xdist workers inherit
    it with the environment (they start after this hook)."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import tempfile

    config._trn_accum_jax_cache = tempfile.mkdtemp(prefix="trn-accum-jax-cache-")
    os.environ.update(JAX_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=config._trn_accum_jax_cache)


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
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
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
