"""llama.cpp's `llama-server` as a served anchor, on the same GGUF file pagedserve serves.

bench/llamacpp_setup.sh builds it (from the llama.cpp source the llama-cpp-python sdist vendors)
into ~/.cache/pagedserve/llama.cpp, where this module looks for it. It is started as a user would
tune it for throughput: `-t N -tb N` (both cores for decode and for prompts), `-np SLOTS` parallel
slots with `-cb` continuous batching and `-c SLOTS * ctx_per_slot` context in all; everything else
its defaults, except `--no-repack` on a CPU with AMX (below). llama.cpp computes with the GGUF's own
Q4_1 weights (and its own quantized dot products), so its tokens are not expected to equal a
float32 or bfloat16 model's.

Requests go to its native /completion endpoint, which takes the prompt as token ids without adding
a BOS (an array whose first element is a number) and returns the ids it generated
(`return_tokens`) and, with `n_probs`, each chosen token's log-prob from the raw distribution.
"""
from __future__ import annotations

import os
import subprocess

import _common as C

DIR = os.environ.get("PAGEDSERVE_LLAMACPP_DIR", os.path.expanduser("~/.cache/pagedserve/llama.cpp"))
BINARY = os.path.join(DIR, "bin", "llama-server")


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read().split()
    except OSError:
        return False


def find() -> tuple[str | None, str]:
    """(the llama-server binary, "") when it is built here, else (None, why not)."""
    if not os.access(BINARY, os.X_OK):
        return None, f"no llama-server at {BINARY} (run bench/llamacpp_setup.sh)"
    return BINARY, ""


def version(binary: str) -> str:
    """Its build (`--version`, e.g. 'version: 1 (abc123)') and the sdist it came from."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    build = " ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version"))
    try:
        with open(os.path.join(DIR, "src", "VERSION")) as f:
            source = f.read().strip()
    except OSError:
        source = "source unknown"
    return f"{build or 'version unknown'}; {source}"


class LlamaServer(C.AnchorProcess):
    """llama-server on `port` with `parallel` slots of `ctx_per_slot` tokens each."""

    def __init__(self, binary: str, gguf: str, port: int, num_threads: int, parallel: int, ctx_per_slot: int):
        self.parallel = parallel
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(num_threads), "-tb", str(num_threads),
               "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-cb"]
        # ggml's AMX weight path (an "extra buffer type", chosen when the build's -march=native has
        # AMX) dies with SIGSEGV in ggml_backend_amx_mul_mat at the first graph on an Intel Xeon with
        # AMX; --no-repack leaves the weights as the file has them, with its AVX-512 dot products
        self.no_repack = cpu_has_amx()
        if self.no_repack:
            cmd.append("--no-repack")
        super().__init__("llama-server", cmd, port)

    def wait_ready(self, timeout: float = 300.0) -> "LlamaServer":
        super().wait_ready(timeout)   # /health answers 503 while the model loads
        return self


def body(prompt: list[int], max_tokens: int, n_probs: int = 0, stream: bool = False,
         sampling: dict | None = None) -> dict:
    """A greedy /completion of exactly max_tokens tokens: temperature 0 (greedy), EOS ignored; `sampling`:
    the fields that make it sample instead."""
    return {"prompt": list(prompt), "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "n_probs": n_probs, "stream": stream, **(sampling or {})}


async def complete(session, url: str, prompt: list[int], max_tokens: int, sampling: dict | None = None) -> list[int]:
    return (await C.post_json(session, f"{url}/completion", body(prompt, max_tokens, sampling=sampling)))["tokens"]


async def complete_scored(session, url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The generated ids and each chosen token's log-prob (`n_probs: 1`)."""
    data = await C.post_json(session, f"{url}/completion", body(prompt, max_tokens, n_probs=1))
    probs = data["completion_probabilities"]
    return data["tokens"], [p["logprob"] for p in probs]
