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

demo: $(VENV)/.installed
	$(VENV)/bin/shardplan trace configs/models/gpt-tiny.yaml --batch 8

test: $(VENV)/.installed
	$(VENV)/bin/ruff check shardplan models tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check shardplan models tests benchmarks
	$(VENV)/bin/ruff format --check shardplan models tests benchmarks

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) benchmarks/trace_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
