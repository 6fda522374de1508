# Two commands a fresh machine needs: `make train` and `make test`. Each sets up what is missing first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch is installed first and pinned, so that resolving the project never pulls a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup train test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

train: setup
	$(BIN)/python train.py

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs --durations=25

lint: setup
	$(BIN)/ruff check .
