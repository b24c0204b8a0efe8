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

.PHONY: demo test test-fast install install-dev bench bench-smoke clean

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

# Installs what the tests need and runs the whole suite (GPU tests are deselected).
# Two workers, whole files per worker (module-scoped spawns stay in one process): the suite waits
# on starting interpreters and ranks as much as it computes (docs/testing.md, "Suite time"). Tests
# marked `serial` (elastic restarts) run afterwards, alone; the exit status covers both parts.
PYTEST_WORKERS ?= 2
test: install-dev
	$(PY) -m pytest -q --durations=30 -n $(PYTEST_WORKERS) --dist loadfile -m "not gpu and not serial"; \
	parallel=$$?; $(PY) -m pytest -q -m "serial and not gpu"; serial=$$?; \
	test $$parallel -eq 0 -a $$serial -eq 0

test-fast: install-dev
	$(PY) -m pytest -q -m "not slow and not gpu" -n $(PYTEST_WORKERS) --dist loadfile

bench: install-dev
	$(PY) bench/train_throughput.py

# Every bench at its smallest arguments, as the docs run them: exits 0 and prints its ratio (~2-3 min).
bench-smoke: install-dev
	$(PY) -m pytest -q tests/bench -m "" -s

clean:
	rm -rf runs outputs wandb .pytest_cache
