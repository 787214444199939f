# QLoRA recipes. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# Command-line variables (ARGS='-x -q tests/...') would otherwise reach every make started below
# this one, through MAKEFLAGS and the environment: e.g. the `make plan-...` a test runs would pass
# the pytest arguments to plan.py. Nothing here runs a sub-make, so none needs them.
MAKEOVERRIDES :=
unexport ARGS SWEEP
# Every recipes/NAME.yaml is a target `make NAME` (train it: scripts/launch.py checks the GPUs it is
# sized for first) and `make plan-NAME` (its memory plan for that hardware, no GPU needed).
RECIPE_FILES := $(sort $(wildcard recipes/*.yaml))
RECIPES := $(basename $(notdir $(RECIPE_FILES)))
SWEEP ?= rank_lr

.DEFAULT_GOAL := help

# The pinned lock first (hatchling, the build backend, is in it), then this package itself,
# editable, without re-resolving dependencies or fetching a build environment:
# `qlora` and `python scripts/...` then import the checkout's qlora_recipes.
$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "installing requirements.txt into $(VENV) (CPU torch; a few minutes the first time):"
	$(PY) -m pip install --progress-bar on -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

.PHONY: help setup train test test-all test-dist lint format smoke plan

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_.-]+:.*?## ' $(MAKEFILE_LIST) | sort | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-24s\033[0m %s\n", $$1, $$2}'
	@echo "recipes: make NAME trains on the hardware it is sized for; make plan-NAME shows its memory plan"
	@for f in $(RECIPE_FILES); do \
		awk -v n="$$(basename $$f .yaml)" 'FNR > 1 && /^# / { sub(/^# /, ""); printf "  \033[36m%-24s\033[0m %s\n", n, $$0; exit }' $$f; \
	done

setup: $(VENV)/.installed ## create .venv and install the pinned requirements (CPU torch)

train: $(VENV)/.installed ## set up, then run the embedded default (tiny model, NF4 + LoRA + paged 8-bit AdamW); ARGS= adds overrides
	$(PY) train.py $(ARGS)

# Test files spread over TEST_JOBS processes (pytest-xdist), each file whole in one process so a
# module's shared trained run is made once. Each process runs torch on one thread (tests/conftest.py):
# the tiny models gain nothing from a second one, so 2 processes on 2 cores take about half the time
# of one. TEST_JOBS=0 runs everything in this process.
TEST_JOBS ?= 2
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

test: $(VENV)/.installed ## set up, then run the fast CPU test suite
	$(PY) -m pytest $(XDIST) $(ARGS)

test-all: $(VENV)/.installed ## the fast suite plus the slow tests
	$(PY) -m pytest -m 'not gpu' $(XDIST) $(ARGS)

lint: $(VENV)/.installed ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# FSDP and DeepSpeed ZeRO-2/3 as 2 CPU ranks (gloo), slow tests included: installs the optional
# requirements-dist.txt (DeepSpeed) and compiles DeepSpeed's CPU extensions once (a few minutes).
# `make test` (CI) needs no DeepSpeed: its 2-rank run is FSDP; the ZeRO runs are `slow`, run here.
test-dist: $(VENV)/.installed ## install DeepSpeed (requirements-dist.txt), then the multi-rank tests on CPU (FSDP, ZeRO-2/3), slow ones too
	$(PY) -m pip install -q -r requirements-dist.txt
	$(PY) -c "from qlora_recipes.run.dist import build_deepspeed_cpu_ops as b; b()"
	$(PY) -m pytest -m 'not gpu' tests/unit/test_distributed_configs_and_plans.py tests/e2e/test_ddp_ranks_on_cpu.py tests/e2e/test_sharded_training_on_cpu_ranks.py tests/e2e/test_dpo_on_sharded_cpu_ranks.py --durations=0 $(ARGS)

smoke: $(VENV)/.installed ## 3 steps of the default stack: checks an install works
	$(PY) train.py trainer=smoke $(ARGS)

plan: $(VENV)/.installed ## memory plan of a stack without loading it: make plan ARGS='model=llama3.1-8b'
	$(PY) scripts/plan.py $(ARGS)

sweep: $(VENV)/.installed ## a ready sweep from conf/sweep, one job per combination: make sweep SWEEP=rank_lr ARGS='trainer=smoke'
	$(PY) train.py -m +sweep=$(SWEEP) $(ARGS)

summarize: $(VENV)/.installed ## summary.csv/.md/.png of a sweep dir (Pareto front marked): make summarize ARGS=runs/multirun/DATE/TIME
	$(PY) scripts/summarize_sweep.py $(ARGS)

# The shipped image sample (conf/data/shapes.yaml) on a tiny vision-language model: a LLaVA around the
# tiny base, built at first use into TINY_VLM (scripts/make_tiny_vlm.py, seconds on CPU).
TINY_VLM ?= runs/tiny-llava

$(TINY_VLM)/processor_config.json: scripts/make_tiny_vlm.py | $(VENV)/.installed
	$(PY) scripts/make_tiny_vlm.py --out $(TINY_VLM)

.PHONY: shapes
shapes: $(VENV)/.installed $(TINY_VLM)/processor_config.json ## a tiny vision-language model learns the shipped shapes sample (shape and colour of a PNG); ARGS= adds overrides
	$(PY) train.py data=shapes model.name_or_path=$(TINY_VLM) $(ARGS)

.PHONY: sweep summarize $(RECIPES) $(addprefix plan-,$(RECIPES))

$(RECIPES): $(VENV)/.installed
	$(PY) scripts/launch.py $@ $(ARGS)

$(addprefix plan-,$(RECIPES)): plan-%: $(VENV)/.installed
	$(PY) scripts/launch.py --plan $* $(ARGS)

# The name the project is known by: the same recipe as llama2-70b-a100.
.PHONY: llama70b-a100 plan-llama70b-a100
llama70b-a100: llama2-70b-a100
plan-llama70b-a100: plan-llama2-70b-a100

.PHONY: bench-cpu bench-gpu bench-gpu-check bench-planner-cpu bench-planner-sharded

bench-cpu: $(VENV)/.installed ## the CPU benchmark suite (ours vs the plain baseline, planner error); writes bench/results/
	$(PY) -m bench cpu $(ARGS)

bench-planner-cpu: $(VENV)/.installed ## the planner vs measured peak RSS: 36 CPU runs of 1M-600M models; writes bench/results/planner-cpu.*
	$(PY) -m bench planner-cpu $(ARGS)

bench-planner-sharded: $(VENV)/.installed ## per-rank plan vs each rank's peak RSS: 2-rank DDP/FSDP/ZeRO-2/3 on CPU, 16 cases; writes bench/results/planner-sharded.*
	$(PY) -m bench planner-sharded $(ARGS)

bench-gpu: $(VENV)/.installed ## the GPU benchmark suite on the GPU here (8B and 70B shapes); writes bench/results/
	$(PY) -m bench gpu $(ARGS)

bench-gpu-check: $(VENV)/.installed ## the GPU check of everything pending, one device call per part (ARGS='--part 1'); writes bench/results/
	$(PY) -m bench gpu-check $(ARGS)
