"""Memory saved by sharing KV blocks: parallel sampling and beam search (vLLM paper, Fig. 15:
6.1-9.8% and 37.6-55.2% on Alpaca), and the prefix cache on a shared-system-prompt trace.

    python bench/sharing.py            # full: 256 requests per mode, plot to docs/sharing.png
    python bench/sharing.py --quick    # small trace for CI

The control plane is the real one (Engine, Scheduler, BlockManager: fork, copy-on-write, prefix
hashes); the data plane is bench/_fake_engine.py's fake, except for time to first token, which runs a
tiny random Llama through the real ModelRunner in-process.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ALPACA, ROOT, Table, mean, pct, synthetic_trace  # noqa: E402
from _fake_engine import FakeRunner, drive, make_engine, observe_pool  # noqa: E402

from control_plane.sampling_params import SamplingParams  # noqa: E402

PAPER = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}    # % saved, OPT-13B on Alpaca
WIDTHS = (2, 4, 6)
SYSTEM_PROMPT_LEN = 200
RATE = 0.25                   # requests per engine step: about 15 requests live at once
# the tests' tiny Llama, 4 layers and hidden 256: big enough that prefill time is not lost in per-step overhead
TTFT_MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=4)


def sharing_run(kind: str, width: int, trace, args) -> dict:
    dp = FakeRunner(args.pool_blocks, args.block_size, seed=args.seed)
    for tr in trace:
        dp.answer_len[tuple(tr.prompt_ids)] = tr.output_len
    # prefix caching off: the only sharing measured is the request's own (fork + copy-on-write)
    engine = make_engine(dp, caching=False)
    samples = []
    dp.observer = observe_pool(engine, samples)
    if kind == "parallel":   # every sample ends with EOS at the trace's output length
        def params(tr):
            return SamplingParams(max_tokens=ALPACA.output_clip[1], temperature=1.0, n=width)
    else:                    # beams run to the trace's output length
        def params(tr):
            return SamplingParams(max_tokens=tr.output_len, temperature=0.0, best_of=width,
                                  use_beam_search=True, ignore_eos=True)
    label = f"parallel n={width}" if kind == "parallel" else f"beam width {width}"
    asyncio.run(drive(engine, trace, params, label))
    used, private = mean(s.blocks_used for s in samples), mean(s.blocks_private for s in samples)
    return dict(label=label, kind=kind, width=width, used=used, private=private, saving=1 - used / private,
                seqs=mean(s.num_seqs for s in samples), steps=len(samples),
                cow=engine.scheduler.bm.num_cow_copies, preemptions=engine.scheduler.num_preemptions)


def system_prompt(vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed + 7)
    return [rng.randrange(3, vocab_size) for _ in range(SYSTEM_PROMPT_LEN)]


def prefix_run(caching: bool, trace, args) -> dict:
    dp = FakeRunner(args.pool_blocks, args.block_size, seed=args.seed)
    for tr in trace:
        dp.answer_len[tuple(tr.prompt_ids)] = tr.output_len
    engine = make_engine(dp, caching=caching)
    samples = []
    dp.observer = observe_pool(engine, samples)
    asyncio.run(drive(engine, trace, lambda tr: SamplingParams(max_tokens=ALPACA.output_clip[1], temperature=1.0),
                      f"prefix cache {'on' if caching else 'off'}"))
    bm = engine.scheduler.bm
    return dict(caching=caching, hit_rate=bm.prefix_hits / max(1, bm.prefix_queries),
                computed=dp.num_prompt_tokens_computed, total=sum(len(tr.prompt_ids) for tr in trace),
                used=mean(s.blocks_used for s in samples))


def ttft_runs(num_requests: int, rounds: int, args) -> dict:
    """Mean time to first token with the cache off and on, on a REAL (tiny, random) model on CPU."""
    import torch
    from data_plane import attention
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig
    from tests.helpers import tiny_llama

    model = tiny_llama(attn=attention.register(), seed=args.seed, **TTFT_MODEL)
    vocab = model.config.vocab_size
    trace = synthetic_trace(num_requests, args.seed, rate=0.5, vocab_size=vocab,
                            prefix=system_prompt(vocab, args.seed))
    warmup = synthetic_trace(2, args.seed + 1, vocab_size=vocab, prefix=system_prompt(vocab, args.seed + 1))

    def one_run(caching: bool, jobs) -> tuple[list[float], float]:
        cfg = DataPlaneConfig(model="tiny", listen="inproc://bench", block_size=args.block_size, kv_cache_blocks=512)
        runner = ModelRunner(model, cfg, torch.device("cpu"))
        engine = make_engine(runner, max_num_seqs=128, budget=512, caching=caching)
        first: dict[int, float] = {}

        def stamp(requests):             # the step that emits a request's first token ends its TTFT
            now = time.perf_counter()
            for i, r in enumerate(requests):
                if r is not None and i not in first and not r.queue.empty():
                    first[i] = now - r.bench_submitted
        params = lambda tr: SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)   # noqa: E731
        asyncio.run(drive(engine, jobs, params, f"TTFT, tiny Llama, cache {'on' if caching else 'off'}", stamp))
        bm = engine.scheduler.bm
        return [first[i] for i in range(len(jobs))], bm.prefix_hits / max(1, bm.prefix_queries)

    one_run(True, warmup)                # first forwards allocate and warm up; not measured
    times = {False: [], True: []}
    hits = {}
    for _ in range(rounds):              # interleaved, so a change in machine load hits both alike
        for caching in (False, True):
            got, hits[caching] = one_run(caching, trace)
            times[caching].extend(got)
    return dict(times=times, hit_rate=hits, num_params=sum(p.numel() for p in model.parameters()))


def plot(results, prefix, ttft, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    ax = axes[0]
    for i, r in enumerate(results):
        color = "tab:blue" if r["kind"] == "parallel" else "tab:orange"
        ax.bar(i, 100 * r["saving"], color=color, zorder=2)
        ax.text(i, 100 * r["saving"] + 1, f"{100 * r['saving']:.1f}%", ha="center", fontsize=8)
    for kind, xs in (("parallel", (-0.4, 2.4)), ("beam", (2.6, 5.4))):
        lo, hi = PAPER[kind]
        ax.fill_between(xs, lo, hi, color="gray", alpha=0.3, zorder=1,
                        label="vLLM paper (Alpaca)" if kind == "parallel" else None)
    ax.set_xticks(range(len(results)), [r["label"].replace("parallel ", "").replace("beam width", "beam")
                                        for r in results])
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title("Sharing: blocks in use vs private copies")
    ax.legend()
    ax = axes[1]
    ax.bar(["cache off", "cache on"], [p["computed"] for p in prefix], color=["gray", "tab:green"])
    ax.set_ylabel("prompt tokens computed")
    ax.set_title(f"Prefix cache ({SYSTEM_PROMPT_LEN}-token system prompt)")
    ax = axes[2]
    ax.bar(["cache off", "cache on"], [1000 * mean(ttft["times"][c]) for c in (False, True)],
           color=["gray", "tab:green"])
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title("TTFT, tiny random Llama on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trace for CI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="requests per mode (default 256; --quick: 24)")
    ap.add_argument("--pool-blocks", type=int, default=16384, help="KV blocks: roomy, so nothing is preempted")
    ap.add_argument("--plot", default=None, help="PNG path (default docs/sharing.png; --quick: no plot)")
    args = ap.parse_args()
    num_requests = args.requests or (24 if args.quick else 256)
    plot_path = args.plot or (None if args.quick else os.path.join(ROOT, "docs", "sharing.png"))
    started = time.perf_counter()

    trace = synthetic_trace(num_requests, args.seed, rate=RATE)
    print(f"Trace: {num_requests} requests, Poisson arrivals at {RATE} per step, {ALPACA.describe()} "
          f"(vLLM paper's Alpaca means); realized means: "
          f"prompt {mean(len(t.prompt_ids) for t in trace):.1f}, output {mean(t.output_len for t in trace):.1f}")
    results = []
    for kind in ("parallel", "beam"):
        for width in WIDTHS:
            results.append(sharing_run(kind, width, trace, args))
    table = Table(["mode", "saving", "paper", "goal met", "blocks used (shared)", "blocks (private copies)",
                   "live seqs", "CoW copies", "preemptions"])
    for r in results:
        lo, hi = PAPER[r["kind"]]
        table.add(r["label"], pct(r["saving"]), f"{lo}-{hi}%", "yes" if 100 * r["saving"] >= lo else "NO",
                  f"{r['used']:.1f}", f"{r['private']:.1f}", f"{r['seqs']:.1f}", r["cow"], r["preemptions"])
    print(f"\nMemory sharing, block size {args.block_size} (real control plane, fake data plane):")
    print("  blocks used = physical blocks referenced by a block table, sampled at every step, averaged")
    print("  private copies = sum over live sequences of ceil(tokens held / block size), i.e. every sample")
    print("  or beam holding its own copy of all its blocks; saving = 1 - used / private")
    print(table.render())

    prefix_trace = synthetic_trace(num_requests, args.seed, rate=RATE, prefix=system_prompt(49152, args.seed))
    prefix = [prefix_run(caching, prefix_trace, args) for caching in (False, True)]
    table = Table(["prefix cache", "hit rate", "prompt tokens computed", "of prompt tokens", "blocks used (mean)"])
    for p in prefix:
        table.add("on" if p["caching"] else "off", pct(p["hit_rate"]), p["computed"], p["total"], f"{p['used']:.1f}")
    print(f"\nPrefix cache: {num_requests} requests, each a {SYSTEM_PROMPT_LEN}-token system prompt + an Alpaca-like "
          f"user prompt (hit rate = prompt tokens found in the cache / prompt tokens looked up):")
    print(table.render())

    ttft = ttft_runs(6 if args.quick else 32, 1 if args.quick else 2, args)
    table = Table(["prefix cache", "mean TTFT", "median TTFT", "hit rate", "requests"])
    for caching in (False, True):
        ts = sorted(ttft["times"][caching])
        table.add("on" if caching else "off", f"{1000 * mean(ts):.1f} ms", f"{1000 * ts[len(ts) // 2]:.1f} ms",
                  pct(ttft["hit_rate"][caching]), len(ts))
    print(f"\nTime to first token: tiny random Llama ({ttft['num_params'] / 1e6:.1f} M parameters, "
          f"tests/helpers.py with {TTFT_MODEL}) through the real ModelRunner on CPU, float32, same "
          f"system-prompt trace shape (4 output tokens, arrivals 0.5 per step); wall-clock, a loaded CPU adds noise:")
    print(table.render())
    speedup = mean(ttft["times"][False]) / max(1e-9, mean(ttft["times"][True]))
    print(f"mean TTFT without the cache / with it: {speedup:.2f}x")
    if plot_path:
        plot(results, prefix, ttft, plot_path)
        print(f"plot written to {plot_path}")
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
