# The two quick-start commands (README): `make run` and `make test`. Both create the
# virtual environment themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlsys-installed

.PHONY: setup run test lint bench-ledger

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a range would make pip fetch a multi-GB CUDA build; 2.13.0 is
	# the CPU build these machines carry (pyproject's range accepts it).
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/rlsys run configs/quickstart.yaml

test: setup
	$(BIN)/pytest -q -ra --durations=25

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench-ledger: setup
	$(BIN)/python benchmarks/bench_ledger.py
