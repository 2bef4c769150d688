# Every target creates .venv and installs what it needs when missing, without asking.
# The install is keyed on pyproject.toml + constraints.txt, so a second run starts at once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help install test lint format crds clean

help:
	@echo "make test     create .venv if missing, install everything, run the tests"
	@echo "make lint     ruff (lint + format check) and mypy"
	@echo "make crds     regenerate crds/ from the API types"
	@echo "make format   apply ruff's formatter and autofixes"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	# torch first, the CPU build: otherwise deepspeed makes pip pull a multi-GB CUDA torch.
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[operator,trainer,dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check operator trainer_image tests bench
	$(BIN)/ruff format --check operator trainer_image tests bench
	$(BIN)/mypy operator/rtrl trainer_image/rtrl_trainer

format: $(STAMP)
	$(BIN)/ruff check --fix operator trainer_image tests bench
	$(BIN)/ruff format operator trainer_image tests bench

crds: $(STAMP)
	$(BIN)/rtrl crds

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
