"""Helpers shared by the benchmarks: the machine line, the request trace, a served pagedserve
subprocess, the transformers model, percentiles and a progress line on stderr.

The benchmarks are run as scripts (`python bench/x.py`), so they put the repository root on
sys.path themselves; this module is imported as `_common` from the bench folder.
"""
from __future__ import annotations

import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Token ids below this are SmolLM2's special and byte-level tokens; random prompts skip them so
# that they look like ordinary text to the model.
FIRST_ORDINARY_TOKEN = 100

# Length distributions of the paper's two workloads, scaled down to what a 2-core CPU can serve.
# The paper (Kwon et al. 2023, fig. 11) reports mean input/output lengths of 19.3/58.5 tokens for
# Alpaca and 161.3/338.0 for ShareGPT. Alpaca is kept at its size; ShareGPT is scaled by about
# 1/2.5 and both are clipped to prompts of 8-128 and outputs of 16-128 tokens.
# name: (median prompt, sigma, median output, sigma), lengths drawn log-normal
WORKLOADS = {
    "alpaca": (16, 0.55, 48, 0.6),
    "sharegpt": (56, 0.6, 100, 0.45),
}
PROMPT_RANGE = (8, 128)
OUTPUT_RANGE = (16, 128)


@dataclass
class TraceRequest:
    prompt_ids: list[int]
    output_len: int


def make_trace(num_requests: int, seed: int, vocab_size: int, workload: str = "mixed",
               prompt_range=PROMPT_RANGE, output_range=OUTPUT_RANGE) -> list[TraceRequest]:
    """A fixed, seeded list of requests; "mixed" draws each request from alpaca or sharegpt at even odds."""
    rng = random.Random(seed)
    trace = []
    for _ in range(num_requests):
        kind = workload if workload != "mixed" else rng.choice(sorted(WORKLOADS))
        p_med, p_sigma, o_med, o_sigma = WORKLOADS[kind]
        prompt_len = _clip(rng.lognormvariate(math.log(p_med), p_sigma), prompt_range)
        output_len = _clip(rng.lognormvariate(math.log(o_med), o_sigma), output_range)
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(prompt_len)]
        trace.append(TraceRequest(prompt, output_len))
    return trace


def _clip(x: float, bounds) -> int:
    return int(min(max(round(x), bounds[0]), bounds[1]))


def describe_trace(trace: list[TraceRequest]) -> str:
    p = [len(r.prompt_ids) for r in trace]
    o = [r.output_len for r in trace]
    return (f"{len(trace)} requests, prompt tokens {min(p)}-{max(p)} (mean {sum(p) / len(p):.1f}), "
            f"output tokens {min(o)}-{max(o)} (mean {sum(o) / len(o):.1f}, total {sum(o)})")


def machine_line(num_threads: int) -> str:
    """What the numbers were measured on: the CPU is often shared, so the load is printed too."""
    import torch
    import transformers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"machine: {platform.processor() or platform.machine()}, {cores} cores usable, "
            f"load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}{gpu}; torch {torch.__version__} with "
            f"{num_threads} thread{'s' if num_threads > 1 else ''} per process, transformers {transformers.__version__}")


_last_progress = [0.0, ""]


def cpu_check(num_threads: int) -> str:
    """Many small matmuls (decode-sized) with 1 thread, num_threads and every core. When other work holds
    the cores, torch's OpenMP threads wait on each other at every op and N threads can run many
    times slower than 1: then every timing of this run is mostly noise, whatever the system."""
    import torch
    x, w = torch.randn(8, 576), torch.randn(576, 1536)
    seconds = {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for n in sorted({1, num_threads, cores or 1}):
        torch.set_num_threads(n)
        x @ w
        t = time.perf_counter()
        for _ in range(100):
            x @ w
        seconds[n] = time.perf_counter() - t
    torch.set_num_threads(num_threads)
    line = "cpu check (100 decode-sized matmuls): " + ", ".join(
        f"{n} thread{'s' if n > 1 else ''} {1000 * s:.0f} ms" for n, s in seconds.items())
    if seconds[num_threads] > 1.5 * seconds[1]:
        line += (f"  WARNING: {num_threads} threads are slower than 1, the cores are busy with other work; "
                 "timings are unreliable (try --num-threads 1)")
    return line


def progress(message: str) -> None:
    """One rewritten line on a terminal; in a log, a line every few seconds at most."""
    if sys.stderr.isatty():
        print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)
    elif time.monotonic() - _last_progress[0] >= 5.0:
        print(message, file=sys.stderr, flush=True)
        _last_progress[0] = time.monotonic()
    _last_progress[1] = message


def progress_done() -> None:
    """Ends the progress line (in a log: prints its last state)."""
    if sys.stderr.isatty():
        print(file=sys.stderr, flush=True)
    elif _last_progress[1]:
        print(_last_progress[1], file=sys.stderr, flush=True)
    _last_progress[:] = [0.0, ""]


class Timer:
    """Seconds since the benchmark started, for the phase lines on stderr."""
    start = time.monotonic()

    @classmethod
    def note(cls, what: str) -> None:
        print(f"[{time.monotonic() - cls.start:6.1f}s] {what}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m control_plane.cli serve` on a free port, logging to a temporary file."""

    def __init__(self, num_threads: int, extra_args: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="pagedserve-bench-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        # the data plane's metrics port is turned off: a fixed port would clash with other servers
        cmd = [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(self.port),
               "--num-threads", str(num_threads), "--data-plane-metrics-port", "0", *(extra_args or [])]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self.log_path)   # its tail was already shown if the server failed


async def complete_greedy(session, url, model, prompt, max_tokens) -> list[int]:
    """One greedy completion over HTTP (EOS ignored: exactly max_tokens tokens); its token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
    return data["choices"][0]["token_ids"]


def get_json(url: str) -> dict:
    import json
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def bench_device():
    """Where the transformers anchors run: the GPU when there is one, as the data plane's default."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_hf_model(num_threads: int, attn_implementation: str = "sdpa", device=None):
    """SmolLM2 in float32 through transformers' own loader, as the data plane loads it; on `device`,
    by default bench_device()."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.config import default_model_path, split_model_path
    torch.set_num_threads(num_threads)
    folder, gguf_file = split_model_path(default_model_path())
    Timer.note("loading the transformers model")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    Timer.note("transformers model loaded")
    return model.to(device or bench_device()).eval()
