# Set-up is part of every target: the virtualenv is created on first use and refreshed when
# pyproject.toml changes. torch is pinned to 2.13.0 and installed first so that no other
# requirement pulls a multi-GB CUDA build on CPU machines.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longstraw-installed

.PHONY: demo test test-fast lint bench clean-demo gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The main job on the embedded default: no server, local storage, a tiny checkpoint it builds.
demo: $(STAMP)
	$(VENV)/bin/longstraw train

# The test suite (CPU); pytest exits 5 when no test ran, which fails this target too.
# One worker per core (at most 4), each test file on one worker (its module fixtures, servers and
# shared runs stay together); tests/conftest.py gives each worker its share of the cores' threads.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile

# The fast subset (tests/README.md): leaves out the tests that start processes (other ranks, a
# `longstraw` CLI or a Python child, a server), need the S3 or Prefect servers, or are slow.
FAST := not slow and not processes and not s3 and not prefect
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile -m "$(FAST)"

lint: $(STAMP)
	$(VENV)/bin/ruff check longstraw tests bench
	$(VENV)/bin/ruff format --check longstraw tests bench

bench: $(STAMP)
	$(VENV)/bin/longstraw bench --help

# The wheels the GPU machine's image lacks (bench/gpu_wheels.txt), for its Python 3.12, into
# bench/gpu_wheels/ (ignored by git): the device call carries that folder (docs/benchmarks.md, GPU).
gpu-wheels:
	python3 bench/gpu_wheels.py
