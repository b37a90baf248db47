# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create the virtual environment on first use (python3 -m venv + pip install -e .[dev]).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# The suite runs on one worker process per core (at most 4; each makes its own 8 CPU devices),
# a test file per worker at a time, so a file's module fixtures are built once.
TEST_WORKERS ?= -n auto --maxprocesses=4 --dist loadfile

.PHONY: demo test lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# Trains a small GPT on 8 CPU devices emulated as 4 A100 + 4 V100 (a fresh run each time).
demo: $(VENV)/.installed
	rm -rf runs/demo
	$(VENV)/bin/shardplan train configs/train/demo.yaml

test: $(VENV)/.installed
	$(VENV)/bin/ruff check shardplan models tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=25 $(TEST_WORKERS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check shardplan models tests benchmarks
	$(VENV)/bin/ruff format --check shardplan models tests benchmarks

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) benchmarks/trace_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
