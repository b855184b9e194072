# peagle-pipeline: every target installs what it needs first and is safe to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEMO_DIR := .demo
PYTEST_ARGS ?=

.PHONY: setup test test-fast test-crash lint fmt demo demo-assets bench clean

setup: $(STAMP)

# torch is pinned to the local CPU wheel (2.13.0); everything else comes from PyPI.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo-assets: setup
	$(PY) scripts/prepare_demo.py --out $(DEMO_DIR)

test: setup demo-assets
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not real and not vllm and not crashloop" $(PYTEST_ARGS)

test-crash: setup
	$(PY) -m pytest -q -m "crash or crashloop" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check peagle_pipeline tests bench scripts
	$(VENV)/bin/ruff format --check peagle_pipeline tests bench scripts

fmt: setup
	$(VENV)/bin/ruff format peagle_pipeline tests bench scripts

demo: setup demo-assets
	$(PY) scripts/demo.py --dir $(DEMO_DIR)

bench: setup demo-assets
	$(PY) bench/run_all.py --out bench/results

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache build *.egg-info
