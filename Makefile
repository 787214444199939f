# QLoRA recipes. `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.DEFAULT_GOAL := help

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

.PHONY: help setup train test test-all lint format smoke plan

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_.-]+:.*?## ' $(MAKEFILE_LIST) | sort | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-24s\033[0m %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the pinned requirements (CPU torch)

train: $(VENV)/.installed ## set up, then run the embedded default (tiny model, NF4 + LoRA + paged 8-bit AdamW); ARGS= adds overrides
	$(PY) train.py $(ARGS)

test: $(VENV)/.installed ## set up, then run the fast CPU test suite
	$(PY) -m pytest $(ARGS)

test-all: $(VENV)/.installed ## the fast suite plus the slow tests
	$(PY) -m pytest -m 'not gpu' $(ARGS)

lint: $(VENV)/.installed ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

smoke: $(VENV)/.installed ## 3 steps of the default stack: checks an install works
	$(PY) train.py trainer=smoke $(ARGS)

plan: $(VENV)/.installed ## memory plan of a stack without loading it: make plan ARGS='model=llama3.1-8b'
	$(PY) scripts/plan.py $(ARGS)
