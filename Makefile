# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create the virtual environment on first use (python3 -m venv + pip install -e .[dev]).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

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
	$(PY) -m pytest -q --durations=25

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check shardplan models tests benchmarks
	$(VENV)/bin/ruff format --check shardplan models tests benchmarks

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) benchmarks/trace_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
