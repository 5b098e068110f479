"""What every benchmark shares: the request traces, the progress line on stderr, a served pagedserve
subprocess (tests/servers.py's Server, which the end-to-end tests use too), the machine line,
statistics and tables, and the transformers model the anchors run.

Two kinds of trace:
- make_trace: lengths for the HTTP benchmarks (WORKLOADS, log-normal around a median), all
  submitted at once or with arrivals the caller draws;
- synthetic_trace: the memory benchmarks' Alpaca-like and ShareGPT-like traces (log-normal around
  the paper's means) with Poisson arrivals counted in engine steps (bench/_fake_engine.py plays them).

The benchmarks are run as scripts (`python bench/x.py`), so they put the repository root on
sys.path themselves; this module is imported as `_common` from the bench folder.
"""
from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.servers import Server, free_port, wait_until_healthy  # noqa: E402,F401  (for the anchors)

SERVER_STARTUP_TIMEOUT = 600.0    # a bench server may load its model beside transformers on a busy CPU

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
    output_len: int          # tokens to generate (the fake data plane: the final EOS included)
    arrival_step: int = 0    # synthetic_trace: the engine step it arrives at


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


@dataclass(frozen=True)
class Lengths:
    """A synthetic_trace workload: log-normal prompt and output lengths with these means, clipped."""
    name: str
    prompt_mean: float
    prompt_sigma: float
    prompt_clip: tuple[int, int]
    output_mean: float
    output_sigma: float
    output_clip: tuple[int, int]   # the upper clip doubles as the requests' max_tokens

    def describe(self) -> str:
        return (f"{self.name}: prompt ~ lognormal(mean {self.prompt_mean}, sigma {self.prompt_sigma}) clipped "
                f"{list(self.prompt_clip)}, output ~ lognormal(mean {self.output_mean}, sigma {self.output_sigma}) "
                f"clipped {list(self.output_clip)}")


# the vLLM paper's mean lengths: Alpaca 19.31 / 58.45 tokens, ShareGPT 161.31 / 337.99
ALPACA = Lengths("Alpaca-like", 19.31, 0.6, (4, 128), 58.45, 0.8, (8, 256))
SHAREGPT = Lengths("ShareGPT-like", 161.31, 1.0, (4, 1024), 337.99, 0.8, (8, 1024))
FIRST_SYNTHETIC_TOKEN = 3           # 0 pad, 1 bos, 2 eos are never drawn as ordinary tokens


def _lognormal(rng: random.Random, mean: float, sigma: float, clip: tuple[int, int]) -> int:
    mu = math.log(mean) - sigma * sigma / 2          # so that E[X] = mean before clipping
    return min(max(round(rng.lognormvariate(mu, sigma)), clip[0]), clip[1])


def synthetic_trace(num_requests: int, seed: int, rate: float = 0.0, vocab_size: int = 49152,
                    prefix: list[int] | None = None, lengths: Lengths = ALPACA) -> list[TraceRequest]:
    """Seeded; token ids uniform over the vocabulary; arrivals Poisson with `rate` requests per engine
    step (0: all at step 0); `prefix`: tokens put before every prompt (a shared system prompt)."""
    lz = lengths
    rng = random.Random(seed)
    trace, clock = [], 0.0
    for _ in range(num_requests):
        if rate > 0:
            clock += rng.expovariate(rate)
        prompt = [rng.randrange(FIRST_SYNTHETIC_TOKEN, vocab_size)
                  for _ in range(_lognormal(rng, lz.prompt_mean, lz.prompt_sigma, lz.prompt_clip))]
        trace.append(TraceRequest(list(prefix or []) + prompt,
                                  _lognormal(rng, lz.output_mean, lz.output_sigma, lz.output_clip), int(clock)))
    return trace


def describe_trace(trace: list[TraceRequest]) -> str:
    p = [len(r.prompt_ids) for r in trace]
    o = [r.output_len for r in trace]
    return (f"{len(trace)} requests, prompt tokens {min(p)}-{max(p)} (mean {sum(p) / len(p):.1f}), "
            f"output tokens {min(o)}-{max(o)} (mean {sum(o) / len(o):.1f}, total {sum(o)})")


def machine_line(num_threads: int) -> str:
    """What the numbers were measured on: the CPU is often shared, so the load is printed too."""
    import torch
    import transformers

    from ops import cpu_kernels
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    # a run of the kernels built for another CPU says so, with the vectors torch's own ops were held to
    target = "" if cpu_kernels.MARCH == "native" else \
        f"; kernels built for -march={cpu_kernels.MARCH}, torch's vectors {torch.backends.cpu.get_cpu_capability()}"
    return (f"machine: {platform.processor() or platform.machine()}, {cores} cores usable, "
            f"load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}{gpu}; torch {torch.__version__} with "
            f"{num_threads} thread{'s' if num_threads > 1 else ''} per process, transformers {transformers.__version__}"
            f"{target}")


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


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@dataclass
class Table:
    """A plain text table, printed with aligned columns."""
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells) -> None:
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [max(len(r[i]) for r in [self.header] + self.rows) for i in range(len(self.header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()   # noqa: E731
        return "\n".join([line(self.header), line(["-" * w for w in widths])] + [line(r) for r in self.rows])


def start_server(num_threads: int, extra_args: list[str] | None = None) -> Server:
    """`pagedserve serve` on a free port with `num_threads` data-plane threads, logging to a temporary
    file (server.log() shows its tail); call wait_ready() on it, and stop() when done."""
    return Server("bench", ["--num-threads", str(num_threads), *(extra_args or [])], log_interval=None,
                  env={"TOKENIZERS_PARALLELISM": "false"}, startup_timeout=SERVER_STARTUP_TIMEOUT,
                  swap_space_gib=None)   # the server's own default: a bench measures what users get


class AnchorProcess:
    """Another engine's server as an anchor (vLLM, llama-server): `cmd` in its own process group, its
    output in a temporary file (log_tail() shows its end), ready once `health` answers 200."""

    def __init__(self, what: str, cmd: list[str], port: int, env: dict | None = None, health: str = "/health"):
        import subprocess
        import tempfile
        self.what, self.url, self.health = what, f"http://127.0.0.1:{port}", health
        fd, self.log_path = tempfile.mkstemp(prefix=f"{what.replace(' ', '-')}-bench-", suffix=".log")
        self._log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float) -> "AnchorProcess":
        wait_until_healthy(self.proc, self.url + self.health, timeout, self.log_tail, self.what, poll=0.5)
        return self

    def log_tail(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        """SIGTERM to the whole group (vLLM's engine core and workers are child processes), then SIGKILL."""
        import subprocess
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()   # the log stays, for a look after a failed run


def greedy_body(model, prompt, max_tokens, logprobs: int | None = None, stream: bool = False,
                sampling: dict | None = None) -> dict:
    """An OpenAI /v1/completions body for a greedy completion of exactly max_tokens tokens (EOS ignored;
    `ignore_eos` and `return_token_ids` are vLLM's extensions, which pagedserve serves too); `sampling`:
    the fields that make it sample instead (temperature, top_p, ...)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **(sampling or {})}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if stream:
        body["stream"] = True
    return body


async def post_json(session, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
    return data


async def complete_greedy(session, url, model, prompt, max_tokens, sampling: dict | None = None) -> list[int]:
    """One greedy completion over HTTP (EOS ignored: exactly max_tokens tokens; `sampling`: greedy_body's);
    its token ids."""
    data = await post_json(session, f"{url}/v1/completions", greedy_body(model, prompt, max_tokens, sampling=sampling))
    return data["choices"][0]["token_ids"]


async def complete_greedy_scored(session, url, model, prompt, max_tokens) -> tuple[list[int], list[float]]:
    """As complete_greedy, with `logprobs: 1`: the token ids and each chosen token's log-prob."""
    data = await post_json(session, f"{url}/v1/completions", greedy_body(model, prompt, max_tokens, logprobs=1))
    choice = data["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


async def stream_timing(session, url: str, body: dict) -> tuple[float, float]:
    """POSTs a streaming request (server-sent events, as OpenAI's and llama-server's) and reads it to the
    end: (seconds until the first event with data, seconds until the stream ended), from the send."""
    start = time.perf_counter()
    first = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                first = time.perf_counter() - start
    end = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"no event in the stream of {url}")
    return first, end


def get_json(url: str) -> dict:
    import json
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def bench_device():
    """Where the transformers anchors run: the GPU when there is one, as the data plane's default."""
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_hf_model(num_threads: int, attn_implementation: str = "sdpa", device=None, path: str | None = None):
    """SmolLM2 (or the model at `path`) in float32 through transformers' own loader, as the data plane
    loads it; on `device`, by default bench_device()."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.config import default_model_path, split_model_path
    torch.set_num_threads(num_threads)
    folder, gguf_file = split_model_path(path or default_model_path())
    Timer.note("loading the transformers model")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    Timer.note("transformers model loaded")
    return model.to(device or bench_device()).eval()



def default_runner(num_threads: int, listen: str, dtype: str = "float32", path: str | None = None, **settings):
    """The data plane's ModelRunner on the default model (or the one at `path`), in this process on the CPU: loaded in float32
    and narrowed to `dtype` by the runner after it finds the GGUF codes, as the data plane does; what the
    loading made is then frozen out of the collector's reach, as there (data_plane/collector.py).
    `settings`: other DataPlaneConfig fields (kv_cache_blocks, ...)."""
    import atexit

    import torch

    from data_plane import attention, collector
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig, default_model_path
    collector.hold()
    model = load_hf_model(num_threads, attn_implementation=attention.register(), device="cpu", path=path)
    config = DataPlaneConfig(model=path or default_model_path(), listen=listen, dtype=dtype, **settings)
    runner = ModelRunner(model, config, torch.device("cpu"))
    collector.settle()   # as the data plane before serving
    atexit.register(collector.release)   # and unfrozen at exit, as there
    return runner

@contextlib.contextmanager
def plain_linears(model):
    """Within the block, the linear layers that ops/linear.py routed through the few-row kernel run
    torch's own forward: the bare-model baseline."""
    import torch
    routed = {m: m.__dict__.pop("forward") for m in model.modules()
              if type(m) is torch.nn.Linear and "forward" in m.__dict__}
    try:
        yield
    finally:
        for module, forward in routed.items():
            module.forward = forward
