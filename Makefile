# The two front-door commands: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Everything runs offline: no hub look-ups, wandb offline.
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export WANDB_MODE=offline
export TOKENIZERS_PARALLELISM=false

.PHONY: demo test test-fast install install-dev bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(VENV)/bin/python
	$(PIP) install -q -e ".[llama]"

install-dev: $(VENV)/bin/python
	$(PIP) install -q -e ".[dev]"

# Runs the main recipe (apps/llama) on its embedded default: SmolLM2-135M adapted to the
# shipped classical-Chinese corpus, on CPU, in minutes.
demo: install
	$(PY) -m apps.llama.demo

# Installs what the tests need and runs the whole suite (GPU tests are deselected). The Triton
# kernel tests run in a process of their own: without a GPU they need Triton's interpreter, which
# Triton fixes process-wide when its language module is first imported.
test: install-dev
	$(PY) -m pytest -q --ignore=tests/kernels
	$(PY) -m pytest -q tests/kernels

test-fast: install-dev
	$(PY) -m pytest -q -m "not slow" --ignore=tests/kernels
	$(PY) -m pytest -q -m "not slow" tests/kernels

bench: install-dev
	$(PY) bench/train_throughput.py

clean:
	rm -rf runs outputs wandb .pytest_cache
