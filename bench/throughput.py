"""Offline throughput against the anchors: one fixed, seeded trace, all requests submitted at once;
or, with --single, one request alone.

    python bench/throughput.py                    # 256 requests, every system, float32 and bfloat16
    python bench/throughput.py --num-requests 64 --workload exp64    # the issue's trace
    python bench/throughput.py --single           # one request: 57 prompt tokens, 133 output tokens
    python bench/throughput.py --quick            # CI-sized: 8 requests of 8 prompt and 8 output tokens
    python bench/throughput.py --model DIR --systems av   # another model (bench/random_model.py writes one)

Systems, all on SmolLM2-135M-Instruct (or --model), greedy, EOS ignored so every request produces exactly its
drawn number of tokens; (a), (b), (c) and (v) run once per dtype of --dtypes:
  (a) pagedserve through its REST API: a `serve` subprocess, a real aiohttp client, every
      request in flight at once;
  (b) transformers' `generate` on static batches in trace order (left-padded; a batch runs until
      its longest request is done; only each request's own tokens count as output);
  (c) transformers' continuous batching (`init_continuous_batching`), with the same KV memory
      (pagedserve's pool in tokens), step budget and batch size as (a);
  (v) vLLM's CPU build (bench/vllm_setup.sh installs it in its own venv) through its OpenAI server,
      both cores bound to the model, `--dtype` the run's, its other settings its defaults, the same
      1 GiB of KV memory;
  (l) llama.cpp's llama-server (bench/llamacpp_setup.sh builds it) on the same GGUF, computing with
      its Q4_1 weights (so once, whatever --dtypes): `-t N -tb N -np SLOTS -cb`, tried at each
      --llama-np and reported at its best, as a user tuning it would.
(v) and (l) are skipped with a clear "not run" line when they are not set up.
--model DIR: a safetensors folder instead of SmolLM2 for (a), (b), (c), (v) and the reference, with
SmolLM2's vocabulary or a larger one (the traces draw token ids from it); (l) then runs --llama-gguf, the
same model converted (llama.cpp's convert_hf_to_gguf.py), and is not run without it.
(a) runs at the server's defaults unless --max-num-seqs / --max-num-batched-tokens are given.
Workloads: "mixed", "alpaca" and "sharegpt" are described in _common.WORKLOADS, clipped at
--max-prompt-len / --max-output-len; "exp64" is the trace vLLM was first measured on here:
prompts uniform over 8-96 tokens, outputs exponential with mean 64, at most 256.

Exactness. In float32 the tokens of (a) are checked against (b), (c), (v) and (l). In bfloat16
(or float16) the reference is transformers' `generate` in that dtype, one request at a time, on
the first --agreement-requests requests: for each system, the greedy tokens equal to the reference
up to each request's first divergence (summed; and how many requests are identical), from its
timed run, and the largest difference of the chosen tokens' log-probs before the first divergence,
from a second, untimed pass of the same requests (all at once) asking for `logprobs: 1` (served
systems only). (l) is compared with that reference too.

--rounds N: the served systems (a), (v), (l) run N times in turn (llama-server after the first round at
its best slot count of that round), each round's ratios taken within the round, and the goals judged on
the median ratio: a machine whose speed drifts between runs moves every system of a round alike. The
tokens of later rounds are checked against the first round's.

--single: one request alone, best of --single-repeats: time to the first token, decode time per
token after it (streamed: (end - first token) / (tokens - 1)), and overall tokens per second.

--sampling: every request of the served systems samples instead (temperature 0.7, top-p 0.9, no seed), as
a chat client often asks; llama-server's own top-k and min-p are turned off, so that all keep the tokens of
the same rule. Each system draws with its own generator: no token check then.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF loader's progress bars would swamp the output
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

VOCAB_SIZE = 49152   # SmolLM2's: the trace is drawn before any model is loaded
GOAL_VS_STATIC, GOAL_VS_HF_CB = 8.0, 3.0
GOAL_VS_VLLM = {"float32": 1.5, "bfloat16": 1.2}   # issue [15]; float32 also with tokens identical
GOAL_VS_LLAMA_BATCHED, GOAL_VS_LLAMA_SINGLE = 3.0, 1.0
SYSTEMS = "abcvl"
SERVED = "avl"   # the systems --rounds repeats
# --sampling's request fields: the OpenAI systems', then llama-server's (whose top-k and min-p are on by default)
SAMPLING = {"openai": {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0},
            "llama": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0}}
LLAMA = "gguf"   # (l)'s row: it computes with the GGUF's own weights, not in a --dtypes dtype


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="mixed", choices=["mixed", "exp64", *sorted(C.WORKLOADS)])
    ap.add_argument("--batch-size", type=int, default=32, help="static batch size of (b)")
    ap.add_argument("--num-threads", type=int, default=2, help="threads of every system")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a safetensors folder to serve instead of SmolLM2's GGUF (by (l): --llama-gguf)")
    ap.add_argument("--llama-gguf", default=None, metavar="FILE",
                    help="with --model: the same model as a GGUF file for (l)")
    ap.add_argument("--systems", default=SYSTEMS, help="which of a, b, c, v, l to run")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated dtypes of (a), (b), (c) and (v), each run in turn")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="one dtype only (the same as --dtypes DTYPE)")
    ap.add_argument("--cb-page-size", type=int, default=256, help="(c)'s page size in tokens (its default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="step budget of (a) and (c) (default: the server's)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="batch size of (a) and (c) (default: the server's)")
    # The other benches clip outputs at 128 tokens; here the long tail of ShareGPT-like outputs is
    # kept, since the cost of static batching (a batch lasts as long as its longest request) is
    # the tail. The log-normal shapes stay those of _common.WORKLOADS.
    ap.add_argument("--max-prompt-len", type=int, default=256, help="prompt length clip")
    ap.add_argument("--max-output-len", type=int, default=512, help="output length clip")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="pagedserve's KV pool, and so (c)'s cache (default: the server's, 1 GiB on CPU, "
                         "90%% of free memory on a GPU)")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="one more flag for (a)'s `pagedserve serve`, e.g. --serve-flag=--decode-graphs=off")
    ap.add_argument("--llama-np", default="8,16,32,64",
                    help="llama-server's parallel slots (-np) to try; (l) reports its best")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=384,
                    help="llama-server's context per slot (-c is slots times this; raised to the trace's "
                         "longest request when that is longer)")
    ap.add_argument("--agreement-requests", type=int, default=64, metavar="K",
                    help="bfloat16/float16: compare with transformers' one-at-a-time reference on the first "
                         "K requests (0: no reference)")
    ap.add_argument("--single", action="store_true",
                    help="one request alone instead of the trace: ms per token of each system")
    ap.add_argument("--single-prompt-len", type=int, default=57)
    ap.add_argument("--single-output-len", type=int, default=133)
    ap.add_argument("--single-repeats", type=int, default=3, help="--single: best of this many")
    ap.add_argument("--quick", action="store_true", help="8 requests of 8 prompt and 8 output tokens")
    ap.add_argument("--sampling", action="store_true",
                    help="the served systems sample (temperature 0.7, top-p 0.9) instead of greedy decoding")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the served systems (a), (v), (l) this many times in turn and judge the goals on "
                         "the median of each round's ratio (not with --single)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.rounds > 1 and args.single):
        ap.error("--rounds: a positive count, and 1 with --single (which takes the best of --single-repeats)")
    if args.quick:
        args.num_requests = 8
        args.single_prompt_len, args.single_output_len = 8, 8
    args.dtypes = [args.dtype] if args.dtype else [d for d in args.dtypes.split(",") if d]
    for d in args.dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"--dtypes: {d!r} is not float32, bfloat16 or float16")
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: {args.systems!r} has letters other than {SYSTEMS}")
    if args.model is not None:
        vocab = _vocab_size(args.model)
        if vocab is None or vocab < VOCAB_SIZE:
            ap.error(f"--model: {args.model} has no config.json with a vocab_size of at least {VOCAB_SIZE} "
                     f"(the traces' token ids are SmolLM2's; bench/random_model.py writes such a model)")
        args.model = os.path.abspath(args.model)
    if args.llama_gguf is not None:
        if args.model is None or not os.path.isfile(args.llama_gguf):
            ap.error("--llama-gguf: a GGUF file of --model's model (without --model, (l) runs the default model's)")
        args.llama_gguf = os.path.abspath(args.llama_gguf)
    args.llama_np = [int(n) for n in args.llama_np.split(",") if n]
    if not args.llama_np or min(args.llama_np) < 1:
        ap.error("--llama-np: a comma-separated list of positive slot counts")
    from shared.config import ControlPlaneConfig
    args.server_flags = [x for name in ("max_num_seqs", "max_num_batched_tokens") if getattr(args, name) is not None
                         for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    # (c) gets what (a) runs with: the given values, else the server's defaults
    args.max_num_seqs = args.max_num_seqs or ControlPlaneConfig.max_num_seqs
    args.max_num_batched_tokens = args.max_num_batched_tokens or ControlPlaneConfig.max_num_batched_tokens
    return args


def _vocab_size(folder: str) -> int | None:
    import json
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def exp64_trace(num_requests: int, seed: int) -> list:
    """Prompts uniform over 8-96 tokens, outputs exponential with mean 64, clipped to 1-256."""
    import random
    rng = random.Random(seed)
    return [C.TraceRequest([rng.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(rng.randint(8, 96))],
                           min(256, max(1, round(rng.expovariate(1 / 64))))) for _ in range(num_requests)]


def single_request(args) -> "C.TraceRequest":
    import random
    rng = random.Random(args.seed)
    return C.TraceRequest([rng.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(args.single_prompt_len)],
                          args.single_output_len)


@dataclass
class Run:
    """A timed run of the trace; `scored`: the untimed pass with log-probs (tokens, log-probs) per request."""
    seconds: float
    outputs: list[list[int]]
    scored: list[tuple[list[int], list[float]]] | None = None
    note: str = ""


@dataclass
class Single:
    """One request alone, the best of each figure over the repeats (seconds)."""
    ttft: float
    decode: float      # per token after the first
    total: float
    tokens: list[int]
    scored: list[tuple[list[int], list[float]]] | None = None
    note: str = ""

    @classmethod
    def best(cls, timings: list[tuple[float, float]], tokens: list[int], **kw) -> "Single":
        n = len(tokens)
        return cls(min(f for f, _ in timings), min((e - f) / max(1, n - 1) for f, e in timings),
                   min(e for _, e in timings), tokens, **kw)


@dataclass
class Client:
    """How to ask one served system: `complete(session, prompt, n)` -> token ids; `scored` -> (ids,
    log-probs); `stream(prompt, n)` -> (url, body) of a streamed request."""
    complete: object
    scored: object
    stream: object


def openai_client(url: str, sampled: bool = False) -> Client:
    """pagedserve and vLLM: OpenAI /v1/completions with their token-id extensions (`sampled`: --sampling's)."""
    model = C.get_json(f"{url}/v1/models")["data"][0]["id"]
    sampling = SAMPLING["openai"] if sampled else None
    return Client(lambda s, p, n: C.complete_greedy(s, url, model, p, n, sampling),
                  lambda s, p, n: C.complete_greedy_scored(s, url, model, p, n),
                  lambda p, n: (f"{url}/v1/completions", C.greedy_body(model, p, n, stream=True, sampling=sampling)))


def llama_client(url: str, sampled: bool = False) -> Client:
    import llamacpp_anchor as L
    sampling = SAMPLING["llama"] if sampled else None
    return Client(lambda s, p, n: L.complete(s, url, p, n, sampling), lambda s, p, n: L.complete_scored(s, url, p, n),
                  lambda p, n: (f"{url}/completion", L.body(p, n, stream=True, sampling=sampling)))


def _session():
    import aiohttp
    # limit=0: aiohttp's default of 100 connections would hold back the rest of the trace
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=6 * 3600))


# --- served systems: (a), (v), (l) ----------------------------------------------------------
async def run_served(client: Client, trace, label: str, scored_requests: int = 0) -> Run:
    """The whole trace at once, timed; then, untimed, the first `scored_requests` again with log-probs."""
    async with _session() as s:
        await client.complete(s, trace[0].prompt_ids[:4], 2)   # warm-up, not timed
        done = 0

        async def one(req):
            nonlocal done
            tokens = await client.complete(s, req.prompt_ids, req.output_len)
            done += 1
            C.progress(f"{label}: {done}/{len(trace)} requests done")
            return tokens
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(r) for r in trace))
        elapsed = time.perf_counter() - start
        C.progress_done()
        scored = None
        if scored_requests:
            scored = list(await asyncio.gather(*(client.scored(s, r.prompt_ids, r.output_len)
                                                 for r in trace[:scored_requests])))
    return Run(elapsed, list(outputs), scored)


async def run_single_served(client: Client, req, repeats: int, scored: bool) -> Single:
    """One request alone: once plain (warm-up; its tokens are checked), then streamed `repeats` times."""
    async with _session() as s:
        tokens = await client.complete(s, req.prompt_ids, req.output_len)
        timings = [await C.stream_timing(s, *client.stream(req.prompt_ids, req.output_len)) for _ in range(repeats)]
        lps = [await client.scored(s, req.prompt_ids, req.output_len)] if scored else None
    return Single.best(timings, tokens, scored=lps)


# --- (b) static batches with transformers' generate ----------------------------------------
def run_static(model, trace, batch_size: int) -> tuple[float, list[list[int]]]:
    import torch
    pad = 0   # masked out: its value does not matter

    def generate(batch):
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):   # left padding: every prompt ends where generation starts
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        longest = max(r.output_len for r in batch)
        # eos_token_id=None as a keyword: a GenerationConfig object would be merged with the model's EOS
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=pad)
        return [out[i, width:width + r.output_len].tolist() for i, r in enumerate(batch)]

    generate(trace[:2])   # warm-up, not timed
    outputs: list[list[int]] = []
    batches = [trace[i:i + batch_size] for i in range(0, len(trace), batch_size)]
    start = time.perf_counter()
    for k, batch in enumerate(batches):
        C.progress(f"(b) static batches: batch {k + 1}/{len(batches)} ({len(batch)} requests)")
        outputs.extend(generate(batch))
    elapsed = time.perf_counter() - start
    C.progress_done()
    return elapsed, outputs


# --- (c) transformers' continuous batching -------------------------------------------------
def run_hf_cb(model, trace, pool_tokens: int, args) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    # eos -1: no stop token, as ignore_eos in (a); without psutil the manager cannot size its
    # cache from free memory on CPU, so the size is given: the same KV tokens as pagedserve's pool
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r.output_len for r in trace))
    cb = ContinuousBatchingConfig(page_size=args.cb_page_size, num_blocks=max(1, pool_tokens // args.cb_page_size),
                                  max_batch_tokens=args.max_num_batched_tokens,
                                  max_requests_per_batch=args.max_num_seqs, use_cuda_graph=False)
    with torch.inference_mode():   # the generation thread inherits the caller's inference mode
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
    try:
        def wait_for(ids: set[str]) -> dict[str, list[int]]:
            got = {}
            while len(got) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the generation thread stopped: "
                                           f"{manager.background_thread_status.fatal_error!r}")
                    continue
                if result.is_finished() and result.request_id in ids:
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    got[result.request_id] = list(result.generated_tokens)
                    if len(ids) > 1:
                        C.progress(f"(c) transformers continuous batching: {len(got)}/{len(ids)} requests done")
            return got
        manager.add_request(trace[0].prompt_ids[:4], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        wait_for({"warmup"})   # allocates the cache: not timed
        start = time.perf_counter()
        for i, r in enumerate(trace):
            manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1)
        got = wait_for({f"r{i}" for i in range(len(trace))})
        elapsed = time.perf_counter() - start
        C.progress_done()
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    return elapsed, [got[f"r{i}"] for i in range(len(trace))]


# --- transformers alone: --single's (b), and the reference of the reduced-precision dtypes ---
def run_single_hf(model, req, repeats: int) -> Single:
    """transformers' generate on the one request; the first token's time is when the first logits
    processor call sees the prefill's logits."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores
    ids = torch.tensor([req.prompt_ids], device=model.device)

    def generate() -> list[int]:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.output_len,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Stamp()]))
        return out[0, ids.shape[1]:].tolist()
    tokens = generate()   # warm-up, not timed
    timings = []
    for _ in range(repeats):
        stamps.clear()
        start = time.perf_counter()
        generate()
        timings.append((stamps[0] - start, time.perf_counter() - start))
    return Single.best(timings, tokens)


def reference(model, requests) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy generate, one request at a time (no padding, no batch), in the model's dtype:
    the tokens and each chosen token's log-prob (log_softmax of its raw logits, in float32)."""
    import torch
    out = []
    for k, r in enumerate(requests):
        C.progress(f"(r) transformers reference, one request at a time: {k + 1}/{len(requests)}")
        ids = torch.tensor([r.prompt_ids], device=model.device)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.output_len,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, ids.shape[1]:].tolist()
        out.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                             for step, t in zip(gen.logits, tokens)]))
    C.progress_done()
    return out


# --- comparison ----------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, list[str]]:
    """Requests whose tokens differ, and where the first few diverge."""
    diverged = [f"request {i} at token {first_divergence(a, b)}/{len(a)}"
                for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    return len(diverged), diverged[:5]


def agreement(ref, outputs, scored=None) -> str:
    """Against the reference's (tokens, log-probs): the tokens equal up to each request's first
    divergence (summed), the requests identical, and (with `scored`, that system's (tokens, log-probs))
    the largest |log-prob difference| of the chosen tokens before its first divergence, and their mean (the
    largest alone grows with the tokens compared: a system that agrees longer is compared at more places)."""
    equal = sum(first_divergence(r, o) for (r, _), o in zip(ref, outputs))
    identical = sum(r == o for (r, _), o in zip(ref, outputs))
    total = sum(len(r) for r, _ in ref)
    line = f"tokens equal to the first divergence {equal}/{total}, requests identical {identical}/{len(ref)}"
    if scored is not None:
        diffs = [abs(a - b) for (rt, rl), (st, sl) in zip(ref, scored)
                 for a, b in list(zip(rl, sl))[:first_divergence(rt, st)]]
        line += f", max |logprob diff| {max(diffs, default=0.0):.4f}, mean {sum(diffs) / max(len(diffs), 1):.4f}"
    return line


def names(args) -> dict[str, str]:
    return {"a": "(a) pagedserve, REST API, all requests at once" if not args.single else "(a) pagedserve, REST API",
            "b": f"(b) transformers generate, static batches of {args.batch_size}" if not args.single
            else "(b) transformers generate",
            "c": "(c) transformers continuous batching (generation thread)",
            "v": "(v) vLLM CPU build, REST API, both cores bound",
            "l": f"(l) llama.cpp llama-server, {_gguf_name(args)}" + ("" if args.single else ", best -np")}


def _gguf_name(args) -> str:
    return "Q4_1 GGUF" if args.llama_gguf is None else os.path.basename(args.llama_gguf)


def table_keys(args, keys: str = SYSTEMS):
    """(key, dtype) of every row of the systems run among `keys`, in table order: (l) once, in its own row."""
    return [(key, dtype) for dtype in [*args.dtypes, LLAMA] for key in args.systems
            if key in keys and (key == "l") == (dtype == LLAMA)]


def rows(args, runs, failures):
    """(key, dtype, the row's label, its run) in table order; a system that did not run gets its
    'not run' row printed here instead."""
    name = names(args)
    for key, dtype in table_keys(args):
        label = f"{name[key]:<58} {dtype:<9}"
        if (key, dtype) in runs:
            yield key, dtype, label, runs[key, dtype]
        elif (key, dtype) in failures:
            print(f"{label} not run: {failures[key, dtype]}")


def print_ratios(args, figure: dict, goals, what: str = "ratio", judged: bool = True) -> None:
    """(a)'s figure over each anchor's, per dtype; goals: (anchor key, goal or None, remark) per dtype;
    judged: whether these ratios decide the goals (not where --rounds takes the median instead)."""
    for dtype, key, their, goal, remark in anchors(args, goals):
        if ("a", dtype) in figure and their in figure:
            ratio = figure["a", dtype] / figure[their]
            print(f"{what} (a)/({key}) {dtype}: {ratio:.2f}{verdict(goal, remark, ratio) if judged else ''}")


def anchors(args, goals):
    """(dtype, anchor key, the anchor's row key, goal or None, remark) for each dtype run and each of
    goals(dtype)."""
    return [(dtype, key, (key, LLAMA if key == "l" else dtype), goal, remark)
            for dtype in args.dtypes for key, goal, remark in goals(dtype)]


def verdict(goal, remark: str, ratio: float) -> str:
    return f"  (goal >= {goal:g}{remark}: {'met' if ratio >= goal else 'not met'})" if goal else ""


def throughput_goals(dtype):
    return [("b", GOAL_VS_STATIC, ""), ("c", GOAL_VS_HF_CB, ""), ("v", GOAL_VS_VLLM.get(dtype), ""),
            ("l", GOAL_VS_LLAMA_BATCHED, " (issue [15]'s goal is on exp64)")]


def report_throughput(args, trace, runs, failures) -> None:
    useful = sum(r.output_len for r in trace)
    print(f"\n{'system':<58} {'dtype':<9} {'seconds':>9} {'output tok/s':>13}")
    rate = {}
    for key, dtype, label, run in rows(args, runs, failures):
        produced = sum(len(o) for o in run.outputs)
        assert produced == useful, f"{label.strip()} produced {produced} tokens, the trace asks {useful}"
        rate[key, dtype] = useful / run.seconds
        print(f"{label} {run.seconds:>9.1f} {rate[key, dtype]:>13.1f}{'  ' + run.note if run.note else ''}")
    print()
    print_ratios(args, rate, throughput_goals, "ratio" if args.rounds == 1 else "round 1 ratio", args.rounds == 1)
    report_tokens(args, runs, len(trace), lambda run: run.outputs)


def report_rounds(args, trace, rounds: list[dict], failures: list[dict]) -> None:
    """--rounds: each served system's tok/s round by round, and (a)'s ratio to each anchor in the same
    round, judged on the median; the tokens of every later round against the first's."""
    useful = sum(r.output_len for r in trace)
    print(f"\n{args.rounds} rounds, output tok/s in each (the systems in turn within a round):")
    for key, dtype in table_keys(args, SERVED):
        figures = [f"{useful / r[key, dtype].seconds:.1f}" if (key, dtype) in r else "-" for r in rounds]
        print(f"  ({key}) {dtype:<9} {' '.join(f'{f:>7}' for f in figures)}")
    for dtype, key, their, goal, remark in anchors(args, throughput_goals):
        ratios = [r[their].seconds / r["a", dtype].seconds for r in rounds if ("a", dtype) in r and their in r]
        if key in SERVED and ratios:
            middle = statistics.median(ratios)
            print(f"ratio (a)/({key}) {dtype}, round by round: {' '.join(f'{x:.2f}' for x in ratios)}; "
                  f"median {middle:.2f}{verdict(goal, remark, middle)}")
    differ = 0
    for i, (r, failed) in enumerate(zip(rounds[1:], failures[1:]), start=2):
        if args.sampling:   # (each round draws anew)
            break
        for (key, dtype), why in failed.items():
            print(f"round {i}: ({key}) {dtype} not run: {why}")
        for (key, dtype), run in r.items():
            if (key, dtype) in rounds[0]:
                n, where = compare(rounds[0][key, dtype].outputs, run.outputs)
                differ += n > 0
                if n:
                    print(f"round {i}: ({key}) {dtype}: {n} of {len(trace)} requests' tokens differ from round 1's "
                          f"({'; '.join(where)}{' ...' if n > len(where) else ''})")
    if not differ and not args.sampling:
        later = "round 2" if len(rounds) == 2 else f"rounds 2-{len(rounds)}"
        print(f"{later}: every system's tokens identical to its own in round 1")


def report_tokens(args, runs, count: int, outputs_of) -> None:
    """float32: (a)'s tokens against every other system's; reduced precision: every system against
    transformers' one-at-a-time reference."""
    if args.sampling:
        print("token check: none (--sampling: each system draws with its own generator)")
        return
    for dtype in args.dtypes:
        if dtype == "float32" and ("a", dtype) in runs:
            ours = outputs_of(runs["a", dtype])
            for key in "bcvl":
                other = runs.get((key, LLAMA if key == "l" else dtype))
                if other is not None:
                    n, where = compare(ours, outputs_of(other))
                    detail = f" ({'; '.join(where)}{' ...' if n > len(where) else ''})" if n else ""
                    note = f"  [(l) computes with {_gguf_name(args)}'s weights]" if key == "l" else ""
                    print(f"token check (a) vs ({key}) float32: {n} of {count} requests differ, "
                          f"{count - n}/{count} identical{detail}{note}")
        ref = runs.get(("r", dtype))
        if ref is not None:
            k = len(ref.scored)
            print(f"agreement with transformers {dtype} greedy, one request at a time (first {k} requests):")
            for key in "abcvl":
                run = runs.get((key, LLAMA if key == "l" else dtype))
                if run is not None:
                    label = f"({key}) {_gguf_name(args) if key == 'l' else dtype}"
                    print(f"  {label:<16} {agreement(ref.scored, outputs_of(run)[:k], run.scored)}")


def report_single(args, req, runs, failures) -> None:
    print(f"\none request: {len(req.prompt_ids)} prompt tokens, {req.output_len} output tokens, "
          f"best of {args.single_repeats} (each figure on its own)")
    print(f"{'system':<58} {'dtype':<9} {'TTFT ms':>8} {'decode ms/tok':>14} {'decode tok/s':>13} {'overall tok/s':>14}")
    decode = {}
    for key, dtype, label, one in rows(args, runs, failures):
        assert len(one.tokens) == req.output_len, f"{label.strip()}: {len(one.tokens)} tokens"
        decode[key, dtype] = 1 / one.decode
        print(f"{label} {1000 * one.ttft:>8.1f} {1000 * one.decode:>14.2f} {1 / one.decode:>13.1f} "
              f"{req.output_len / one.total:>14.1f}{'  ' + one.note if one.note else ''}")
    print()
    print_ratios(args, decode, lambda dtype: [("b", None, ""), ("v", None, ""), ("l", GOAL_VS_LLAMA_SINGLE, "")],
                 "decode ratio")
    report_tokens(args, runs, 1, lambda one: [one.tokens])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.single:
        req = single_request(args)
        trace = [req]
    elif args.quick:
        trace = C.make_trace(args.num_requests, args.seed, VOCAB_SIZE, args.workload, (8, 8), (8, 8))
    elif args.workload == "exp64":
        trace = exp64_trace(args.num_requests, args.seed)
    else:
        trace = C.make_trace(args.num_requests, args.seed, VOCAB_SIZE, args.workload,
                             (C.PROMPT_RANGE[0], args.max_prompt_len), (C.OUTPUT_RANGE[0], args.max_output_len))
    reduced = [d for d in args.dtypes if d != "float32"]
    k = 0 if args.sampling else min(args.agreement_requests, len(trace))
    if args.sampling and set(args.systems) - set(SERVED):
        raise SystemExit(f"--sampling runs the served systems only ({', '.join(SERVED)}), not {args.systems}")
    print(C.machine_line(args.num_threads))
    print(C.cpu_check(args.num_threads))
    if args.single:
        print(f"single request: seed {args.seed}, {len(req.prompt_ids)} prompt tokens, {req.output_len} output tokens")
    else:
        print(f"trace: seed {args.seed}, workload {args.workload}: {C.describe_trace(trace)}")
    print(f"model: {args.model or 'SmolLM2-135M-Instruct'}, dtypes {', '.join(args.dtypes)} (llama.cpp: {_gguf_name(args)}), "
          f"{'sampled ' + str(SAMPLING['openai']) if args.sampling else 'greedy'}, EOS ignored; "
          f"systems {args.systems}, all in this run, one after another")
    print(f"(a) and (c): batch size {args.max_num_seqs}, step budget {args.max_num_batched_tokens} tokens "
          f"({'given' if args.server_flags else 'the server defaults'})")

    def job(client: Client, label: str, scored: bool):
        """The run of one served system; `scored`: with the log-prob pass a reference needs."""
        if args.single:
            return run_single_served(client, req, args.single_repeats, scored)
        return run_served(client, trace, label, k if scored else 0)

    runs: dict = {}
    failures: dict = {}
    pool_tokens: dict = {}
    model = None
    hf_systems = bool({"b", "c"} & set(args.systems))
    rounds, round_failures, llama_np = [], [], args.llama_np
    for i in range(args.rounds):
        # round 1 fills `runs` (with the log-prob passes the references need); later rounds are timed only
        first = i == 0
        this, failed = (runs, failures) if first else ({}, {})
        if args.rounds > 1:
            C.Timer.note(f"round {i + 1} of {args.rounds}")
        for dtype in args.dtypes:
            scored = first and dtype != "float32" and k > 0
            if "a" in args.systems:
                pool = [] if args.kv_cache_gib is None else ["--kv-cache-gib", str(args.kv_cache_gib)]
                chosen = [] if args.model is None else ["--model", args.model]
                server = C.start_server(args.num_threads,
                                        [*args.server_flags, *pool, *chosen, "--dtype", dtype, *args.serve_flag])
                if model is None and (hf_systems or (reduced and k > 0)):   # loads while the data plane loads its own
                    model = C.load_hf_model(args.num_threads, path=args.model)
                try:
                    server.wait_ready()
                    C.Timer.note(f"pagedserve {dtype} ready; running (a)")
                    version = C.get_json(server.url + "/version")
                    pool_tokens[dtype] = version["num_device_blocks"] * version["block_size"]
                    this["a", dtype] = asyncio.run(job(openai_client(server.url, args.sampling), f"(a) pagedserve {dtype}", scored))
                except Exception as exc:   # reported, not hidden
                    C.progress_done()
                    failed["a", dtype] = f"{type(exc).__name__}: {str(exc)[-600:]}"
                finally:
                    server.stop()   # it must not compete for the CPU with the others
            if "v" in args.systems:
                run_vllm(args, dtype, job, this, failed, scored)
        if "l" in args.systems:
            # later rounds run llama-server at the slot count that was its best in the first
            best = run_llama(args, trace, job, this, failed, first and bool(reduced) and k > 0, llama_np)
            llama_np = [best] if best else llama_np
        rounds.append(this)
        round_failures.append(failed)
    for dtype in args.dtypes:
        # the reference only where a system of this dtype (or llama.cpp) has something to compare
        want_ref = dtype != "float32" and k > 0 and (hf_systems or ("l", LLAMA) in runs
                                                      or any((key, dtype) in runs for key in "av"))
        if not (hf_systems or want_ref):
            continue
        if model is None:
            model = C.load_hf_model(args.num_threads, path=args.model)
        import torch
        hf = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
        if "b" in args.systems:
            C.Timer.note(f"running (b) {dtype}")
            if args.single:
                runs["b", dtype] = run_single_hf(hf, req, args.single_repeats)
            else:
                runs["b", dtype] = Run(*run_static(hf, trace, args.batch_size))
        if "c" in args.systems and args.single:
            failures["c", dtype] = "one request alone is (b)'s generate"
        elif "c" in args.systems:
            C.Timer.note(f"running (c) {dtype}")
            # (a)'s pool in tokens; without (a), its default 1 GiB pool at this dtype's size
            tokens = pool_tokens.get(dtype, 1456 * 16 * 32 // torch.finfo(getattr(torch, dtype)).bits)
            try:
                runs["c", dtype] = Run(*run_hf_cb(hf, trace, tokens, args))
            except Exception as exc:   # reported, not hidden: (c) may not run on every machine
                C.progress_done()
                failures["c", dtype] = f"{type(exc).__name__}: {exc}"
        if want_ref:
            C.Timer.note(f"transformers {dtype} reference on the first {k} requests")
            runs["r", dtype] = Run(0.0, [], reference(hf, trace[:k]))
        del hf
    if args.single:
        report_single(args, req, runs, failures)
    else:
        report_throughput(args, trace, runs, failures)
        if args.rounds > 1:
            report_rounds(args, trace, rounds, round_failures)
    print(f"benchmark wall time: {time.monotonic() - C.Timer.start:.0f} s (model loads included)")
    return 1 if any(key == "a" for failed in round_failures for key, _ in failed) else 0


def run_vllm(args, dtype: str, job, runs, failures, scored: bool) -> None:
    import vllm_anchor
    python, why_not = vllm_anchor.find(args.model)
    if python is None:
        failures["v", dtype] = why_not
        return
    C.Timer.note(f"starting vLLM {dtype} (its first start at a dtype compiles the model: minutes)")
    vllm = vllm_anchor.VllmServer(python, C.free_port(), args.num_threads, dtype, model=args.model)
    try:
        vllm.wait_ready()
        C.Timer.note(f"vLLM {dtype} ready; running (v)")
        runs["v", dtype] = asyncio.run(job(openai_client(vllm.url, args.sampling), f"(v) vLLM {dtype}", scored))
    except Exception as exc:   # reported, not hidden
        C.progress_done()
        failures["v", dtype] = f"{type(exc).__name__}: {str(exc)[-600:]}"
    finally:
        vllm.stop()


def run_llama(args, trace, job, runs, failures, scored: bool, slots: list[int]) -> int | None:
    """llama-server at each slot count of `slots` (one slot with --single), its best run kept, and its
    slot count returned; the log-prob pass (for the reference of a reduced-precision dtype) on the first
    of them."""
    import llamacpp_anchor as L
    from shared.config import default_model_path
    binary, why_not = L.find()
    if args.model is not None and args.llama_gguf is None:
        binary, why_not = None, "--model without --llama-gguf: no GGUF of that model"
    if binary is None:
        failures["l", LLAMA] = why_not
        return None
    C.Timer.note(f"llama.cpp: {L.version(binary)}")
    ctx = max(args.llama_ctx_per_slot, max(len(r.prompt_ids) + r.output_len for r in trace))
    tried, errors, no_repack = [], [], False
    for np_ in [1] if args.single else slots:
        server = L.LlamaServer(binary, args.llama_gguf or default_model_path(), C.free_port(), args.num_threads,
                               np_, ctx)
        no_repack = server.no_repack
        try:
            server.wait_ready()
            C.Timer.note(f"llama-server -np {np_} ready; running (l)")
            # the log-prob pass once, on the first -np tried, only when a reference needs it
            tried.append((np_, asyncio.run(job(llama_client(server.url, args.sampling), f"(l) llama.cpp -np {np_}",
                                                   scored and not tried))))
        except Exception as exc:   # reported, not hidden
            C.progress_done()
            errors.append(f"-np {np_}: {type(exc).__name__}: {str(exc)[-600:]}")
        finally:
            server.stop()
    if not tried:
        failures["l", LLAMA] = "; ".join(errors)
        return None
    useful = sum(r.output_len for r in trace)
    if args.single:
        np_, best = tried[0]
        best.note = f"-np 1, -c {ctx}"
    else:
        np_, best = min(tried, key=lambda t: t[1].seconds)
        best.scored = tried[0][1].scored
        best.note = f"-np {np_} of " + ", ".join(f"{n}: {useful / r.seconds:.1f}" for n, r in tried) + " tok/s"
    if no_repack:
        best.note += "; --no-repack (AMX CPU)"
    if errors:
        best.note += "; failed: " + "; ".join(errors)
    runs["l", LLAMA] = best
    return np_


if __name__ == "__main__":
    sys.exit(main())
