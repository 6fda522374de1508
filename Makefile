# Two commands a fresh machine needs: `make train` and `make test`. Each sets up what is missing first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch is installed first and pinned, so that resolving the project never pulls a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup dev train test lint

# `make train` installs what the default run imports and nothing else; `make test` adds every extra the suite tries.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

dev: $(VENV)/.installed-dev

# --no-compile: pip would byte-compile the extras' ~20,000 modules (Ray, Kubernetes, MLflow, transformers, ...) at
# install, most of which no test imports; what is imported is compiled then, once (183-194 s -> 94 s on 2 cores).
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q --no-compile -e '.[dev]'
	touch $@

train: setup
	$(BIN)/python train.py

# Three workers on two cores: a test's processes often wait (on a signal, a peer, SLURM's queue), and a serial run
# keeps ~1.1 of 2 cores busy. A file stays on one worker (its module fixtures are built once); the tests marked serial
# (time bounds, signals) run alone afterwards. Both phases run, and either failing fails the target.
test: dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -rs --durations=25 -n 3 --dist loadfile -m 'not slow and not serial'; parallel=$$?; \
	$(BIN)/python -m pytest -q -rs --durations=10 -m 'serial and not slow'; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

lint: dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports
