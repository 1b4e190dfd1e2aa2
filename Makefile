# The two commands: `make train` (the main job on the CPU fallback) and `make test` (the suite).
# Each sets itself up on a new machine: a venv in .venv, the package and its test extra, and,
# for the Slurm tests, Debian's slurm-wlm when this machine can install it (root + apt).

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp
CPU_DEVICES ?= 8
export JAX_PLATFORMS ?= cpu

.PHONY: install train test lint bench bench-accum dry-run system-deps clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)   ## .venv with the package and its test extra

system-deps:
	bash launch/local/install-system-deps.sh

lint: $(STAMP)
	$(PY) -m ruff check trn_accum tests benchmarks examples
	$(PY) -m ruff format --check trn_accum tests benchmarks examples

test: $(STAMP) system-deps lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

train: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=$(CPU_DEVICES)" \
	  $(VENV)/bin/trn-accum train --config configs/fuji-tiny.toml --run-dir runs/fuji-tiny

bench: $(STAMP)   ## benchmarks/report.json + the figures in docs/benchmarks.md (4-7 min on 2 cores)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(PY) benchmarks/report.py

bench-accum: $(STAMP)   ## the core accumulation benchmark (figures in docs/design.md)
	XLA_FLAGS="--xla_force_host_platform_device_count=8" $(PY) benchmarks/accumulation.py

dry-run: $(STAMP)   ## Fuji 3B on one emulated trn2.48xlarge (64 CPU devices)
	$(VENV)/bin/trn-accum dry-run --config configs/fuji-3b-trn2.toml --devices 64

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
