#!/usr/bin/env bash
# Builds the two base images the stack needs without any image registry, from Debian's packages:
#   $BASE_IMAGE        Debian bookworm with Python 3.11, its headers, venv and g++ (the engine's FROM)
#   $PROMETHEUS_IMAGE  Debian bookworm with Debian's prometheus package (and wget, for the health check)
# Each is a debootstrap'd rootfs imported with `podman import`; an image already present is kept.
# Usage: deploy/stack/base_images.sh WORK_DIR   (needs root, debootstrap and podman)
# Environment: BASE_IMAGE, PROMETHEUS_IMAGE, DEBIAN_MIRROR (default: the mirror apt uses here,
# else deb.debian.org), DEBIAN_SUITE (bookworm).
set -euo pipefail
work=${1:?usage: base_images.sh WORK_DIR}
BASE_IMAGE=${BASE_IMAGE:-localhost/pagedserve-base:bookworm}
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-localhost/pagedserve-prometheus:bookworm}
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}

log() { echo "stack: [base images] $*"; }

mirror() {
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
    # the first plain http(s) Debian mirror apt is configured with (one-line or deb822 format)
    local found
    found=$(grep -rhoE '(^deb|^URIs:)[[:space:]]+(\[[^]]*\][[:space:]]+)?https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
                /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | grep -oE 'https?://[^[:space:]]+' | head -1 || true)
    echo "${found:-http://deb.debian.org/debian}"
}

# rootfs NAME PACKAGES...: a minbase rootfs with PACKAGES installed, cleaned of apt state and of
# anything from this host (resolv.conf, hostname)
rootfs() {
    local dir=$work/rootfs-$1; shift
    rm -rf "$dir"
    local include
    include=$(IFS=,; echo "$*")
    log "debootstrap $DEBIAN_SUITE ($*) into $dir: about 3 minutes"
    # --include installs the packages with their dependencies and no Recommends
    nice -n 15 debootstrap --variant=minbase --include="$include" "$DEBIAN_SUITE" "$dir" "$(mirror)" \
        > "$work/debootstrap-$(basename "$dir").log" 2>&1 \
        || { tail -30 "$work/debootstrap-$(basename "$dir").log" >&2; return 1; }
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/archives/*.deb "$dir"/var/log/* "$dir"/tmp/*
    : > "$dir/etc/resolv.conf"
    echo localhost > "$dir/etc/hostname"
}

import() {   # import DIR IMAGE CHANGES...
    local dir=$1 image=$2; shift 2
    local changes=()
    for c in "$@"; do changes+=(--change "$c"); done
    log "importing $dir as $image"
    tar --numeric-owner -C "$dir" -c . | nice -n 15 podman import --quiet "${changes[@]}" - "$image" >/dev/null
    rm -rf "$dir"
}

mkdir -p "$work"
if podman image exists "$BASE_IMAGE"; then
    log "$BASE_IMAGE present, kept"
else
    rootfs base python3 python3-venv python3-dev g++
    import "$work/rootfs-base" "$BASE_IMAGE" 'ENV LANG=C.UTF-8' 'CMD ["/bin/bash"]'
fi
if podman image exists "$PROMETHEUS_IMAGE"; then
    log "$PROMETHEUS_IMAGE present, kept"
else
    rootfs prometheus prometheus wget
    # the data folder compose mounts a volume on, owned by the unprivileged user the package made
    install -d -o "$(chroot "$work/rootfs-prometheus" id -u prometheus)" \
        -g "$(chroot "$work/rootfs-prometheus" id -g prometheus)" "$work/rootfs-prometheus/prometheus"
    import "$work/rootfs-prometheus" "$PROMETHEUS_IMAGE" 'USER prometheus' 'WORKDIR /prometheus' \
        'ENTRYPOINT ["/usr/bin/prometheus"]' 'EXPOSE 9090' \
        'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
fi
log "done"
