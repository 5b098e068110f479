#!/usr/bin/env bash
# `make stack`: the compose stack without Docker, on loopback: a data plane, a control plane
# and a real Prometheus scraping both (same commands as compose.yaml). Grafana is not started
# (it is not packaged for Debian); use Prometheus's UI, or point a Grafana at it and import
# deploy/grafana/dashboards/pagedserve.json. Ctrl-C stops everything.
#
# Environment: PORT (REST, 8000), DATA_PLANE_PORT (ZeroMQ, 5555), DATA_PLANE_METRICS_PORT (8001),
# PROMETHEUS_PORT (9090), PAGEDSERVE (the console script, default: pagedserve on PATH),
# DATA_PLANE_ARGS (extra flags for the data plane, e.g. "--kv-cache-blocks 64 --num-threads 2").
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8000}
DATA_PLANE_PORT=${DATA_PLANE_PORT:-5555}
DATA_PLANE_METRICS_PORT=${DATA_PLANE_METRICS_PORT:-8001}
PROMETHEUS_PORT=${PROMETHEUS_PORT:-9090}
PAGEDSERVE=${PAGEDSERVE:-pagedserve}
DATA_PLANE_ARGS=${DATA_PLANE_ARGS:-}

if ! command -v prometheus >/dev/null; then
    echo "stack: no prometheus binary; install it: apt-get update && apt-get install -y prometheus" >&2
    exit 1
fi

work=$(mktemp -d -t pagedserve-stack.XXXXXX)
pids=()
stop() {
    trap - INT TERM EXIT
    echo "stack: stopping"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap stop INT TERM EXIT

# the compose config with its targets moved to loopback
sed -e "s/control-plane:8000/127.0.0.1:${PORT}/" -e "s/data-plane:8001/127.0.0.1:${DATA_PLANE_METRICS_PORT}/" \
    deploy/prometheus.yml > "$work/prometheus.yml"

# shellcheck disable=SC2086  # DATA_PLANE_ARGS is a list of flags
"$PAGEDSERVE" data-plane --listen "tcp://127.0.0.1:${DATA_PLANE_PORT}" --metrics-port "$DATA_PLANE_METRICS_PORT" \
    $DATA_PLANE_ARGS &
pids+=($!)
"$PAGEDSERVE" control-plane --host 127.0.0.1 --port "$PORT" --data-plane "tcp://127.0.0.1:${DATA_PLANE_PORT}" &
pids+=($!)
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:${PROMETHEUS_PORT}" --log.level=warn &
pids+=($!)

cat <<MSG
stack: control plane  http://127.0.0.1:${PORT}   (REST, /health, /metrics; ready once the model is loaded)
stack: data plane     http://127.0.0.1:${DATA_PLANE_METRICS_PORT}/metrics
stack: prometheus     http://127.0.0.1:${PROMETHEUS_PORT}   (try: sum(rate(pagedserve_generation_tokens_total[1m])))
stack: Ctrl-C stops everything
MSG
# the first process to exit ends the stack
wait -n "${pids[@]}" || true
