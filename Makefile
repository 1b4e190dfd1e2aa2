# The two commands: `make train` (the main job on the CPU fallback) and `make test` (the suite).
# Each sets itself up on a new machine: a venv in .venv with the package (`make train`: what
# training needs, nothing more), `make test` adds the test extra and, for the Slurm tests,
# Debian's slurm-wlm when this machine can install it (root + apt).

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP_PKG := $(VENV)/.installed-package-stamp
STAMP   := $(VENV)/.installed-stamp
export JAX_PLATFORMS ?= cpu

.PHONY: install train test test-jax-next lint bench bench-publish bench-accum docs dry-run system-deps \
        clean

# The venv: pip brings uv, uv installs the package and its test extra (from uv's cache, in
# seconds against pip's minute on 2 cores; the same packages). Not byte-compiled at install
# (20 s for 14,000 files, most never imported): make's commands write the bytecode of what they
# import, once, even where PYTHONDONTWRITEBYTECODE is set (else each of the hundreds of
# processes the suite starts would compile the sources it imports again). An image sets
# UV_COMPILE_BYTECODE=1 (the Dockerfile's CPU stage). uv reads pip's PIP_FIND_LINKS,
# a local wheel folder such as the one holding a CPU build of torch, as its own UV_FIND_LINKS,
# and PIP_EXTRA_INDEX_URL (the CPU image's PyTorch CPU index) with pip's choice among indexes,
# the best version of any (uv's default takes the first index that has a package).
unexport PYTHONDONTWRITEBYTECODE
ifneq ($(PIP_FIND_LINKS),)
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
ifneq ($(PIP_EXTRA_INDEX_URL),)
export UV_EXTRA_INDEX_URL ?= $(PIP_EXTRA_INDEX_URL)
export UV_INDEX_STRATEGY ?= unsafe-best-match
endif

# The package alone (jax, optax, orbax, safetensors, pyyaml): what `make train` needs.
$(STAMP_PKG): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check 'uv>=0.9'
	$(VENV)/bin/uv pip install -q -p $(PY) -c constraints.txt -e .
	touch $(STAMP_PKG)

# ... and its test extra (torch and transformers for the Hugging Face test among them, ~2 GB).
$(STAMP): $(STAMP_PKG)
	$(VENV)/bin/uv pip install -q -p $(PY) -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)   ## .venv with the package and its test extra

system-deps:
	bash launch/local/install-system-deps.sh

lint: $(STAMP)
	$(PY) -m ruff check trn_accum tests benchmarks examples
	$(PY) -m ruff format --check trn_accum tests benchmarks examples

# Three xdist workers on two cores: many tests wait on subprocesses, Slurm or a timer, and a
# third worker fills that time (the suite on 2 idle cores: 744 s with -n 2, 705 s with -n 3).
# The JAX 0.11.2 pass runs beside the suite at the lowest CPU priority (nice 19), in the time
# the suite leaves idle, and prints its output after the suite's; `make test` fails if either
# fails. At equal priority the two slowed each other (fresh-clone `make test` 826 -> 888 s).
NEXT_LOG := .test-jax-next.log
# The pass runs in its own process group, ended with make's on Ctrl-C or SIGTERM (a background
# job of a non-interactive shell ignores SIGINT: it would outlive an interrupted `make test`),
# in make's session: a new session (setsid) is a new scheduler autogroup, which Linux shares
# the CPU with as an equal whatever its nice (so run, the pass ended in 174 s, against 384-654 s
# at nice 19 in make's session, and took that CPU from the suite).
test: $(STAMP) system-deps lint
	@rm -f $(NEXT_LOG) $(NEXT_LOG).rc; \
	$(PY) -c 'import os, sys; os.setpgid(0, 0); os.execvp("sh", ["sh", "-c", sys.argv[1]])' \
	  'nice -n 19 $(MAKE) --no-print-directory test-jax-next > $(NEXT_LOG) 2>&1; \
	    echo $$? > $(NEXT_LOG).rc' & \
	pass=$$!; trap 'kill -TERM -$$pass 2>/dev/null; exit 130' INT TERM; \
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=20; suite=$$?; \
	wait $$pass; echo "--- the JAX $(JAX_NEXT) pass (run beside the suite):"; cat $(NEXT_LOG); \
	next=$$(cat $(NEXT_LOG).rc); rm -f $(NEXT_LOG) $(NEXT_LOG).rc; exit $$(( suite || next ))

# The second JAX pass: the core, model and HLO-reading tests on the newest JAX the Neuron SDKs
# support (2.34: JAX 0.10.0-0.11.2; the suite runs on constraints.txt's 0.10.0), beside the
# suite in `make test`, alone in `make test-jax-next`. JAX 0.11 needs Python >= 3.12: the first
# of python3.14, 3.13, 3.12 (on PATH, or under pyenv) is used; on a machine with none the pass
# says so in one line and is not run. Its venv is made by uv (the test extra): seconds from
# uv's cache, against pip's minute.
JAX_NEXT       ?= 0.11.2
VENV_NEXT      ?= .venv-jax-next
STAMP_NEXT     := $(VENV_NEXT)/.installed-stamp-$(JAX_NEXT)
PYTHON_NEXT    ?= $(shell for v in 3.14 3.13 3.12; do \
                    for p in python$$v $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v*/bin/python3; do \
                      "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null \
                      && { command -v "$$p" | grep . || echo "$$p"; } && exit; \
                    done; done)
TESTS_JAX_NEXT := tests/test_accumulation.py tests/test_strategy.py tests/test_sharding.py \
                  tests/test_make_mesh.py tests/test_state.py tests/test_multi_steps.py \
                  tests/test_xent.py tests/test_partitioned.py tests/test_gather_once.py \
                  tests/test_reduce_once.py tests/test_reduce_dtype.py \
                  tests/test_summaries.py tests/test_clients.py \
                  tests/test_model.py tests/test_attention.py tests/test_fsdp_program.py \
                  tests/test_hlo.py tests/test_target_memory.py tests/test_neuron_lowering.py

# Left to the suite's JAX alone: the gather-once and reduce-once checks on the Fuji model (the
# same properties are checked here on the MLP of the same files, and the accumulation does not
# know which model it runs: 143 s of the pass's 698 s in a quiet CI on 2026-12-07, where the
# pass ends last), the check that the trainer hands reduce="once" to its step (config
# plumbing); and the tiny Fuji's 10 steps with float32 against bf16 reduction (120 s of the
# pass's 682 s; the bf16 reduction's programs and their dtypes are checked here by the rest of
# tests/test_reduce_dtype.py).
DESELECT_JAX_NEXT := \
  --deselect tests/test_gather_once.py::test_fuji_loss_gathered_once_equals_per_minibatch \
  --deselect tests/test_reduce_once.py::test_fuji_loss_once_equals_per_minibatch_and_full_batch \
  --deselect tests/test_reduce_once.py::test_trainer_step_passes_reduce_from_config \
  --deselect tests/test_reduce_dtype.py::test_tiny_fuji_trains_the_same_with_bf16_reduction

# What those tests import beyond the package: the test extra's runners and clients, not its
# torch (PyPI's torch for Python >= 3.12 is the CUDA build, several GB; only the Hugging Face
# test needs it, and it is not in this pass).
TEST_NEXT_EXTRA := 'pytest>=8,<9' 'pytest-xdist>=3.5' 'flax>=0.12' 'equinox>=0.13' filelock

# constraints.txt's ml_dtypes (its import time), with the JAX of this pass.
ML_DTYPES := $(shell grep -E '^ml_dtypes==' constraints.txt)

$(STAMP_NEXT): pyproject.toml $(STAMP)
	$(VENV)/bin/uv venv -q --clear -p $(PYTHON_NEXT) $(VENV_NEXT)
	$(VENV)/bin/uv pip install -q -p $(VENV_NEXT)/bin/python -e . \
	  jax==$(JAX_NEXT) jaxlib==$(JAX_NEXT) $(ML_DTYPES) $(TEST_NEXT_EXTRA)
	touch $(STAMP_NEXT)

ifeq ($(PYTHON_NEXT),)
test-jax-next:
	@echo "test-jax-next: not run: JAX $(JAX_NEXT) needs Python >= 3.12 and none was found (python3.12-3.14 on PATH or under pyenv); set PYTHON_NEXT=/path/to/python3.12+"
else
test-jax-next: $(STAMP_NEXT)   ## the core and model tests on JAX $(JAX_NEXT) (.venv-jax-next)
	$(VENV_NEXT)/bin/python -m pytest -q -n 2 --dist loadgroup $(TESTS_JAX_NEXT) $(DESELECT_JAX_NEXT)
endif

# The CPU fallback gives the config's mesh its emulated devices itself (8 for fuji-tiny).
train: $(STAMP_PKG)
	$(VENV)/bin/trn-accum train --config configs/fuji-tiny.toml --run-dir runs/fuji-tiny

# Into benchmarks/out/ (ignored): the checkout stays clean. `make bench-publish` also rewrites
# the committed benchmarks/report.json and the figures of docs/benchmarks.md.
bench: $(STAMP_PKG)   ## benchmarks/out/report.json + benchmarks.md (about 10 min on 2 busy cores)
	PJRT_NPROC=16 XLA_FLAGS="--xla_force_host_platform_device_count=8" $(PY) benchmarks/report.py

bench-publish: $(STAMP_PKG)
	PJRT_NPROC=16 XLA_FLAGS="--xla_force_host_platform_device_count=8" $(PY) benchmarks/report.py --publish

bench-accum: $(STAMP_PKG)   ## the core accumulation benchmark (figures in docs/design.md)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(PY) benchmarks/accumulation.py

docs: $(STAMP_PKG)   ## the docs' generated tables from their JSON sources (seconds; tests/test_docs.py checks them)
	$(PY) benchmarks/docs_tables.py

dry-run: $(STAMP_PKG)   ## Fuji 3B on one emulated trn2.48xlarge (64 CPU devices)
	$(VENV)/bin/trn-accum dry-run --config configs/fuji-3b-trn2.toml --devices 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
