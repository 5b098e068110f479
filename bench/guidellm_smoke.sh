#!/usr/bin/env bash
# A short smoke run of guidellm's default chat mode against pagedserve (issue [12]): guidellm sends
# OpenAI chat completions (streamed, content as given by its synthetic data) and reports what failed.
#
#   bench/guidellm_smoke.sh [REQUESTS]     # default 16 requests, one at a time
#
# guidellm 0.8.1 lives in its own venv (PAGEDSERVE_GUIDELLM_VENV, default
# ~/.cache/pagedserve/guidellm-venv), with torch pinned to the local CPU wheel: unpinned, guidellm
# pulls a CUDA torch of several GB. Its synthetic prompts are made with SmolLM2's tokenizer, saved
# from the embedded GGUF into a temporary folder (nothing is downloaded). The server is this
# checkout's `pagedserve serve` with its defaults. Exits non-zero unless every request succeeded.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS="${1:-16}"
PY="${PYTHON:-.venv/bin/python}"
VENV="${PAGEDSERVE_GUIDELLM_VENV:-$HOME/.cache/pagedserve/guidellm-venv}"
if [ ! -x "$VENV/bin/guidellm" ]; then
    echo "installing guidellm 0.8.1 into $VENV (torch pinned to 2.13.0)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet torch==2.13.0 guidellm==0.8.1
fi
WORK="$(mktemp -d)"
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$PY" - "$WORK/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
from shared.config import default_model_path, split_model_path
folder, gguf = split_model_path(default_model_path())
AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(sys.argv[1])
EOF
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$PY" -m control_plane.cli serve --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
    sleep 1
done
echo "pagedserve on :$PORT; guidellm: $REQUESTS chat requests of 64 prompt and 32 output tokens, synchronous"
GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL=WARNING "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
    --profile kind=synchronous \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --tokenizer "kind=hf_auto,model=$WORK/tokenizer" \
    --data "kind=synthetic_text,prompt_tokens=64,output_tokens=32" \
    --output "kind=json,path=$WORK/result.json" \
    --disable-console-interactive
"$PY" - "$WORK/result.json" "$REQUESTS" <<'EOF'
import json
import sys
report = json.load(open(sys.argv[1]))
bench = report["benchmarks"][0]
totals = bench["metrics"]["request_totals"] if "request_totals" in bench.get("metrics", {}) else bench["request_totals"]
ok, errored, incomplete = totals["successful"], totals["errored"], totals["incomplete"]
print(f"guidellm: {ok} successful, {errored} errored, {incomplete} incomplete of {sys.argv[2]} requests")
sys.exit(0 if ok == int(sys.argv[2]) and errored == 0 else 1)
EOF
