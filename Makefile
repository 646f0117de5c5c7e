# Quick start: `make run` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# CI passes the CPU wheel from local disk; a user gets torch from PyPI.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run headless test bench snapshots clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" numpy
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dptui --devices cpu:0,cpu:1,cpu:2 $(ARGS)

headless: $(STAMP)
	$(BIN)/dptui --headless --devices cpu:0,cpu:1,cpu:2 $(ARGS)

# One worker per core: most tests wait on the processes they start (ranks, scripts, dptui).
# loadgroup: tests marked with one xdist_group share a worker, and so a module fixture's launch.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

snapshots: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_snapshots.py --snapshot-update

clean:
	rm -rf $(VENV) build *.egg-info
