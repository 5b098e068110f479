"""Offline throughput against the anchors: one fixed, seeded trace, all requests submitted at once.

    python bench/throughput.py                    # 256 requests (a long run on 2 CPU cores)
    python bench/throughput.py --num-requests 48  # a medium run
    python bench/throughput.py --quick            # CI-sized: 8 requests of 8 prompt and 8 output tokens

Systems, all on SmolLM2-135M-Instruct in float32, greedy, EOS ignored so every request produces
exactly its drawn number of tokens:
  (a) pagedserve through its REST API: a `serve` subprocess, a real aiohttp client, every
      request in flight at once;
  (b) transformers' `generate` on static batches in trace order (left-padded; a batch runs until
      its longest request is done; only each request's own tokens count as output);
  (c) transformers' continuous batching (`init_continuous_batching`), with the same KV memory
      (pagedserve's pool in tokens), step budget and batch size as (a);
  (v) vLLM's CPU build (bench/vllm_setup.sh installs it in its own venv) through its OpenAI server,
      both cores bound to the model, its other settings its defaults, the same 1 GiB of KV memory.
      Skipped with a clear line when it is not installed.
(a) runs at the server's defaults unless --max-num-seqs / --max-num-batched-tokens are given.
Workloads: "mixed", "alpaca" and "sharegpt" are described in _common.WORKLOADS, clipped at
--max-prompt-len / --max-output-len; "exp64" is the trace vLLM was first measured on here:
prompts uniform over 8-96 tokens, outputs exponential with mean 64, at most 256.
Tokens of (a) are checked against (b), (c) and (v).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF loader's progress bars would swamp the output
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

VOCAB_SIZE = 49152   # SmolLM2's: the trace is drawn before any model is loaded
GOAL_VS_STATIC, GOAL_VS_HF_CB, GOAL_VS_VLLM = 8.0, 3.0, 1.2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="mixed", choices=["mixed", "exp64", *sorted(C.WORKLOADS)])
    ap.add_argument("--batch-size", type=int, default=32, help="static batch size of (b)")
    ap.add_argument("--num-threads", type=int, default=2, help="torch threads of every system")
    ap.add_argument("--systems", default="abcv", help="which of a, b, c, v to run")
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the model's dtype in every system (tokens are compared only in float32)")
    ap.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                    help="one more flag for (a)'s `pagedserve serve`, e.g. --serve-flag=--decode-graphs=off")
    ap.add_argument("--quick", action="store_true", help="8 requests of 8 prompt and 8 output tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests = 8
    from shared.config import ControlPlaneConfig
    args.server_flags = [x for name in ("max_num_seqs", "max_num_batched_tokens") if getattr(args, name) is not None
                         for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    # (c) gets what (a) runs with: the given values, else the server's defaults
    args.max_num_seqs = args.max_num_seqs or ControlPlaneConfig.max_num_seqs
    args.max_num_batched_tokens = args.max_num_batched_tokens or ControlPlaneConfig.max_num_batched_tokens
    return args


def exp64_trace(num_requests: int, seed: int) -> list:
    """Prompts uniform over 8-96 tokens, outputs exponential with mean 64, clipped to 1-256."""
    import random
    rng = random.Random(seed)
    return [C.TraceRequest([rng.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(rng.randint(8, 96))],
                           min(256, max(1, round(rng.expovariate(1 / 64))))) for _ in range(num_requests)]


# --- (a) pagedserve over HTTP --------------------------------------------------------------
async def _run_served(url: str, trace, label: str = "(a) pagedserve") -> tuple[float, list[list[int]]]:
    import aiohttp
    # limit=0: aiohttp's default of 100 connections would hold back the rest of the trace
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as s:
        async with s.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        await C.complete_greedy(s, url, model, trace[0].prompt_ids[:4], 2)   # warm-up, not timed
        done = 0

        async def one(req):
            nonlocal done
            tokens = await C.complete_greedy(s, url, model, req.prompt_ids, req.output_len)
            done += 1
            C.progress(f"{label}: {done}/{len(trace)} requests done")
            return tokens
        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(r) for r in trace))
        elapsed = time.perf_counter() - start
    C.progress_done()
    return elapsed, list(outputs)


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


# --- comparison ----------------------------------------------------------------------------
def compare(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, list[str]]:
    """Requests whose tokens differ, and where the first few diverge."""
    diverged = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diverged.append(f"request {i} at token {at}/{len(a)}")
    return len(diverged), diverged[:5]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        trace = C.make_trace(args.num_requests, args.seed, VOCAB_SIZE, args.workload, (8, 8), (8, 8))
    elif args.workload == "exp64":
        trace = exp64_trace(args.num_requests, args.seed)
    else:
        trace = C.make_trace(args.num_requests, args.seed, VOCAB_SIZE, args.workload,
                             (C.PROMPT_RANGE[0], args.max_prompt_len), (C.OUTPUT_RANGE[0], args.max_output_len))
    useful = sum(r.output_len for r in trace)
    print(C.machine_line(args.num_threads))
    print(C.cpu_check(args.num_threads))
    print(f"trace: seed {args.seed}, workload {args.workload}: {C.describe_trace(trace)}")
    print(f"model: SmolLM2-135M-Instruct, {args.dtype}, greedy, EOS ignored; all systems in this run, one after another")
    print(f"(a) and (c): batch size {args.max_num_seqs}, step budget {args.max_num_batched_tokens} tokens "
          f"({'given' if args.server_flags else 'the server defaults'})")

    server = None
    if "a" in args.systems:   # the data plane loads its model while this process loads its own
        pool = [] if args.kv_cache_gib is None else ["--kv-cache-gib", str(args.kv_cache_gib)]
        server = C.start_server(args.num_threads, [*args.server_flags, *pool, "--dtype", args.dtype,
                                                   *args.serve_flag])
    model = C.load_hf_model(args.num_threads) if {"b", "c"} & set(args.systems) else None
    if model is not None and args.dtype != "float32":
        import torch
        model = model.to(getattr(torch, args.dtype))
    results: dict[str, tuple[float, list[list[int]]]] = {}
    failures: dict[str, str] = {}
    pool_tokens = 1456 * 16   # pagedserve's default CPU pool (1 GiB), when (a) is not run
    if server is not None:
        try:
            server.wait_ready()
            C.Timer.note("pagedserve ready; running (a)")
            version = C.get_json(server.url + "/version")
            pool_tokens = version["num_device_blocks"] * version["block_size"]
            results["a"] = asyncio.run(_run_served(server.url, trace))
        finally:
            server.stop()   # it must not compete for the CPU with (b), (c) and (v)
    if "v" in args.systems:
        import vllm_anchor
        python, why_not = vllm_anchor.find()
        if python is None:
            failures["v"] = why_not
        elif args.dtype != "float32":
            failures["v"] = "the vLLM anchor is set up for float32 only"
        else:
            C.Timer.note("starting vLLM (its first start compiles the model: minutes)")
            vllm = vllm_anchor.VllmServer(python, C.free_port(), args.num_threads)
            try:
                vllm.wait_ready()
                C.Timer.note("vLLM ready; running (v)")
                results["v"] = asyncio.run(_run_served(vllm.url, trace, "(v) vLLM"))
            except Exception as exc:   # reported, not hidden
                C.progress_done()
                failures["v"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            finally:
                vllm.stop()
    if "b" in args.systems:
        C.Timer.note("running (b)")
        results["b"] = run_static(model, trace, args.batch_size)
    if "c" in args.systems:
        C.Timer.note("running (c)")
        try:
            results["c"] = run_hf_cb(model, trace, pool_tokens, args)
        except Exception as exc:   # reported, not hidden: (c) may not run on every machine
            C.progress_done()
            failures["c"] = f"{type(exc).__name__}: {exc}"

    names = {"a": "(a) pagedserve, REST API, all requests at once",
             "b": f"(b) transformers generate, static batches of {args.batch_size}",
             "c": "(c) transformers continuous batching (generation thread)",
             "v": "(v) vLLM CPU build, REST API, both cores bound"}
    print(f"\n{'system':<58} {'seconds':>9} {'output tok/s':>13}")
    rate = {}
    for key in "abcv":
        if key in results:
            seconds, outputs = results[key]
            produced = sum(len(o) for o in outputs)
            assert produced == useful, f"{names[key]} produced {produced} tokens, the trace asks {useful}"
            rate[key] = useful / seconds
            print(f"{names[key]:<58} {seconds:>9.1f} {rate[key]:>13.1f}")
        elif key in failures:
            print(f"{names[key]:<58} not run: {failures[key]}")
    for key, goal in (("b", GOAL_VS_STATIC), ("c", GOAL_VS_HF_CB), ("v", GOAL_VS_VLLM)):
        if "a" in rate and key in rate:
            ratio = rate["a"] / rate[key]
            print(f"ratio (a)/({key}): {ratio:.2f}  (goal >= {goal:g}: {'met' if ratio >= goal else 'not met'})")
    for key in "bcv":
        if "a" in results and key in results:
            count, where = compare(results["a"][1], results[key][1])
            detail = f" ({'; '.join(where)}{' ...' if count > len(where) else ''})" if count else ""
            print(f"token check (a) vs ({key}): {count} of {len(trace)} requests differ{detail}")
    print(f"benchmark wall time: {time.monotonic() - C.Timer.start:.0f} s (model loads included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
