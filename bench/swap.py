"""Swapping to CPU memory: how fast blocks move, and what swapping buys under memory pressure.

    python bench/swap.py                   # both parts on SmolLM2 (a few minutes on 2 CPU cores)
    python bench/swap.py --parts 1         # the bandwidth table only
    python bench/swap.py --quick           # CI-sized (the smoke test passes a tiny --model)

Part 1, bandwidth: data_plane.swap.SwapPool on a pool shaped like SmolLM2's
([30 layers, K/V, blocks, 16 tokens, 3 kv heads, 64] float32, 720 KiB a block). k random device
blocks go to k random CPU blocks (swap_out) and back to k random device blocks (swap_in); the
achieved GB/s is compared with a plain copy of the same number of bytes: on CPU `dst.copy_(src)`
between contiguous tensors, on CUDA a copy between a device tensor and pinned host memory (the
PCIe limit), device to host for swap_out and host to device for swap_in. Median of repeated runs,
after a warm-up that has touched every page (a CPU pool starts as untouched zeros).

Part 2, memory pressure: one server per preemption mode (auto, swap, recompute), started one after
another, each with the same small device KV pool (--kv-cache-blocks, so that requests preempt each
other often) and the same seeded trace, all requests sent at once through aiohttp, greedy with EOS
ignored. Reported per mode: output tokens/s, p50/p99 end-to-end latency, preemptions by kind and
swap blocks (from the server's /metrics, taken before and after the run), and whether the greedy
outputs are the same tokens in every mode. Bars of both parts go to docs/swap.png.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import time
import urllib.request

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

MODES = ("auto", "swap", "recompute")
VOCAB_SIZE = 49152                  # SmolLM2's (and the test suite's tiny model's)
# SmolLM2-135M's KV layout: layers, kv heads, head dim; block size 16 as served
POOL_SHAPE = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
DEFAULT_PLOT = os.path.join(C.ROOT, "docs", "swap.png")
REFERENCE_BUFFER_BYTES = 256 * 2 ** 20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="12", help="which parts to run: 1, 2 or 12")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads of part 1 and of every server (default 2, or 1 when the cpu check finds "
                         "2 threads much slower than 1: the cores are busy with other work)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="part 1's device pool")
    ap.add_argument("--pool-blocks", type=int, default=512, help="part 1: blocks of the device pool")
    ap.add_argument("--ks", default="1,8,64,256", help="part 1: blocks moved per call, comma-separated")
    ap.add_argument("--seconds-per-size", type=float, default=1.5, help="part 1: timing budget per k and direction")
    ap.add_argument("--model", default=None, help="part 2: a model dir or .gguf (default: the server's, SmolLM2)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", default="16,64", help="uniform range of prompt tokens")
    ap.add_argument("--output-len", default="32,96", help="uniform range of output tokens (EOS ignored)")
    ap.add_argument("--kv-cache-blocks", type=int, default=48, help="part 2: device KV pool of every server")
    ap.add_argument("--swap-blocks", type=int, default=512, help="part 2: CPU swap pool of every server")
    ap.add_argument("--modes", default=",".join(MODES), help="part 2: preemption modes, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path ('' for none)")
    ap.add_argument("--quick", action="store_true",
                    help="CI-sized: a 64-block pool and k = 1, 8, 32; 8 requests of 16-32 + 16-32 tokens on 8 blocks")
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_blocks, args.ks, args.seconds_per_size = 64, "1,8,32", 0.2
        args.num_requests, args.prompt_len, args.output_len, args.kv_cache_blocks = 8, "16,32", "16,32", 8
        args.swap_blocks = 64
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    args.output_len = tuple(int(x) for x in args.output_len.split(","))
    args.modes = [m for m in args.modes.split(",") if m]
    assert all(m in MODES for m in args.modes), args.modes
    assert max(args.ks) <= args.pool_blocks, "k must not exceed --pool-blocks"
    return args


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by at least two spaces (the smoke tests split on that)."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()   # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# --- part 1: bandwidth of SwapPool against a plain copy -------------------------------------------
def _median_seconds(fn, sync, budget: float, min_reps: int = 5, max_reps: int = 200) -> float:
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(args) -> tuple[str, list[dict]]:
    import torch

    from data_plane.swap import SwapPool
    torch.set_num_threads(args.num_threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    p = POOL_SHAPE
    shape = [p["num_layers"], 2, args.pool_blocks, p["block_size"], p["num_kv_heads"], p["head_dim"]]
    device_pool = torch.empty(shape, dtype=torch.float32, device=device).normal_()
    num_cpu_blocks = max(args.ks)
    swap = SwapPool(device_pool, num_cpu_blocks)
    block_elems = device_pool[:, :, 0].numel()
    block_bytes = block_elems * device_pool.element_size()
    # the reference copies: slices of two buffers of at least 256 MiB, a different slice at every call, so
    # that a small copy is not served from the CPU's caches when the swap's random blocks are not
    ref_elems = max(num_cpu_blocks * block_elems, REFERENCE_BUFFER_BYTES // 4)
    host = torch.empty(ref_elems, dtype=torch.float32, pin_memory=cuda).fill_(1.0)
    other = torch.empty(ref_elems, dtype=torch.float32, device=device).fill_(2.0)
    rng = random.Random(args.seed)
    all_pairs = list(zip(range(num_cpu_blocks), range(num_cpu_blocks)))
    swap.swap_out(all_pairs)   # warm-up: touches every page of the CPU pool (zeros until written)
    swap.swap_in(all_pairs)
    sync()
    where = f"cuda ({torch.cuda.get_device_name()}), CPU pool pinned" if cuda else "cpu"
    head = (f"swap bandwidth: SwapPool on a pool of {shape} float32 on {where}; "
            f"block {block_bytes / 1024:.0f} KiB; CPU pool {num_cpu_blocks} blocks; "
            f"{args.num_threads} torch thread{'s' if args.num_threads > 1 else ''}; median of repeated calls\n"
            f"reference: {'pinned host <-> device copy_ (PCIe)' if cuda else 'contiguous copy_ (memcpy)'} "
            "of the same bytes; ratio = swap GB/s / copy GB/s")
    results = []
    for k in args.ks:
        C.progress(f"part 1: {k} block{'s' if k > 1 else ''}")
        nbytes = k * block_bytes

        def pairs(limit_from: int, limit_to: int):
            return list(zip(rng.sample(range(limit_from), k), rng.sample(range(limit_to), k)))

        # fresh random blocks on every call; drawing them is done outside the timed call
        queue_out = [pairs(args.pool_blocks, num_cpu_blocks) for _ in range(200)]
        queue_in = [pairs(num_cpu_blocks, args.pool_blocks) for _ in range(200)]
        t_out = _median_seconds(lambda: swap.swap_out(queue_out.pop()), sync, args.seconds_per_size)
        t_in = _median_seconds(lambda: swap.swap_in(queue_in.pop()), sync, args.seconds_per_size)
        n = k * block_elems
        slices = [slice(i * n, (i + 1) * n) for i in range(ref_elems // n)]
        turn = iter(range(10 ** 9))

        def copy(dst, src):
            s = slices[next(turn) % len(slices)]
            dst[s].copy_(src[s])
        c_out = _median_seconds(lambda: copy(host, other), sync, args.seconds_per_size)   # as swap_out: to host
        c_in = _median_seconds(lambda: copy(other, host), sync, args.seconds_per_size)
        gb = lambda s: nbytes / s / 1e9   # noqa: E731
        results.append(dict(k=k, mib=nbytes / 2 ** 20, out=gb(t_out), copy_out=gb(c_out), in_=gb(t_in),
                            copy_in=gb(c_in), t_out=t_out, t_in=t_in))
    C.progress_done()
    copy_out_label, copy_in_label = ("D2H copy", "H2D copy") if cuda else ("copy", "copy")
    rows = [[str(r["k"]), f"{r['mib']:.1f}", f"{1e3 * r['t_out']:.2f}", f"{r['out']:.2f}", f"{r['copy_out']:.2f}",
             f"{r['out'] / r['copy_out']:.2f}", f"{1e3 * r['t_in']:.2f}", f"{r['in_']:.2f}", f"{r['copy_in']:.2f}",
             f"{r['in_'] / r['copy_in']:.2f}"] for r in results]
    header = ["blocks", "MiB", "out ms", "swap_out GB/s", f"{copy_out_label} GB/s", "ratio",
              "in ms", "swap_in GB/s", f"{copy_in_label} GB/s", "ratio"]
    del device_pool, swap, host, other
    return head + "\n" + table(header, rows), results


# --- part 2: modes under memory pressure ---------------------------------------------------------
def make_trace(args) -> list[C.TraceRequest]:
    rng = random.Random(args.seed)
    trace = []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(*args.prompt_len)
        prompt = [rng.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in range(prompt_len)]
        trace.append(C.TraceRequest(prompt, rng.randint(*args.output_len)))
    return trace


METRIC_LINE = re.compile(r'^(pagedserve_\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$')


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric name, the label that is not model_name) -> value, for the counters part 2 reports."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if not m or m.group(1) not in ("pagedserve_num_preemptions_total", "pagedserve_swap_blocks_total",
                                      "pagedserve_prefix_cache_hits_total"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        labels.pop("model_name", None)
        values[(m.group(1), ",".join(labels.values()))] = float(m.group(3))
    return values


async def _run_trace(url: str, trace, mode: str) -> tuple[float, list[float], list[list[int]]]:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)   # every request in flight at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async with s.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        await C.complete_greedy(s, url, model, [C.FIRST_ORDINARY_TOKEN + 7] * 4, 2)   # warm-up, not timed
        done = 0

        async def one(req):
            nonlocal done
            sent = time.perf_counter()
            tokens = await C.complete_greedy(s, url, model, req.prompt_ids, req.output_len)
            latency = time.perf_counter() - sent
            done += 1
            C.progress(f"part 2, {mode}: {done}/{len(trace)} requests done")
            return latency, tokens
        start = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in trace))
        elapsed = time.perf_counter() - start
    C.progress_done()
    return elapsed, [lat for lat, _ in results], [tok for _, tok in results]


def run_mode(args, mode: str, trace) -> dict:
    extra = ["--kv-cache-blocks", str(args.kv_cache_blocks), "--swap-blocks", str(args.swap_blocks),
             "--preemption-mode", mode]
    if args.model:
        extra += ["--model", args.model]
    server = C.start_server(args.num_threads, extra)
    try:
        C.Timer.note(f"part 2: starting a server with --preemption-mode {mode}")
        server.wait_ready()
        before = scrape(server.url)
        C.Timer.note(f"part 2, {mode}: sending {len(trace)} requests at once")
        elapsed, latencies, outputs = asyncio.run(_run_trace(server.url, trace, mode))
        after = scrape(server.url)
    except BaseException:
        print(f"server log tail ({mode}):\n{server.log(4000)}", file=sys.stderr)
        raise
    finally:
        server.stop()
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    for req, out in zip(trace, outputs):
        assert len(out) == req.output_len, f"{mode}: {len(out)} tokens, {req.output_len} asked"
    num_tokens = sum(len(o) for o in outputs)
    return dict(mode=mode, seconds=elapsed, tok_per_s=num_tokens / elapsed, num_tokens=num_tokens,
                p50=C.percentile(latencies, 50), p99=C.percentile(latencies, 99), mean=C.mean(latencies),
                recompute=int(delta.get(("pagedserve_num_preemptions_total", "recompute"), 0)),
                swap=int(delta.get(("pagedserve_num_preemptions_total", "swap"), 0)),
                blocks_out=int(delta.get(("pagedserve_swap_blocks_total", "out"), 0)),
                blocks_in=int(delta.get(("pagedserve_swap_blocks_total", "in"), 0)),
                prefix_hits=int(delta.get(("pagedserve_prefix_cache_hits_total", ""), 0)),
                outputs=outputs)


def compare_outputs(runs: list[dict]) -> list[str]:
    """One line per mode after the first: how many requests differ from the first mode's tokens."""
    lines, ref = [], runs[0]
    for run in runs[1:]:
        diff = [i for i, (a, b) in enumerate(zip(ref["outputs"], run["outputs"])) if a != b]
        text = f"greedy outputs {run['mode']} vs {ref['mode']}: {len(diff)} of {len(ref['outputs'])} requests differ"
        if diff:
            first = [next(j for j, (x, y) in enumerate(zip(ref["outputs"][i], run["outputs"][i])) if x != y)
                     for i in diff[:5]]
            text += " (request: first differing token " + ", ".join(f"{i}: {j}" for i, j in zip(diff, first)) + ")"
        lines.append(text)
    same = all(r["outputs"] == ref["outputs"] for r in runs)
    lines.append(f"greedy outputs identical across modes: {'yes' if same else 'NO'}")
    return lines


def pressure_table(runs: list[dict]) -> str:
    rows = [[r["mode"], f"{r['tok_per_s']:.1f}", f"{r['seconds']:.1f}", f"{r['p50']:.1f}", f"{r['p99']:.1f}",
             str(r["recompute"]), str(r["swap"]), str(r["blocks_out"]), str(r["blocks_in"]), str(r["prefix_hits"])]
            for r in runs]
    header = ["mode", "output tok/s", "wall s", "p50 e2e s", "p99 e2e s", "preempt recompute", "preempt swap",
              "swap blocks out", "swap blocks in", "prefix hit tokens"]
    return table(header, rows)


# --- the chart -----------------------------------------------------------------------------------
def plot(path: str, bw: list[dict], runs: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (1 if bw else 0) + (2 if runs else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if bw:
        ax = axes.pop(0)
        x = range(len(bw))
        width = 0.2
        for j, (key, label) in enumerate((("out", "swap_out"), ("copy_out", "copy (out dir.)"),
                                          ("in_", "swap_in"), ("copy_in", "copy (in dir.)"))):
            ax.bar([i + (j - 1.5) * width for i in x], [r[key] for r in bw], width, label=label)
        ax.set_xticks(list(x), [str(r["k"]) for r in bw])
        ax.set_xlabel("blocks moved per call")
        ax.set_ylabel("GB/s")
        ax.set_title("SwapPool bandwidth vs plain copy", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if runs:
        ax1, ax2 = axes
        modes = [r["mode"] for r in runs]
        bars = ax1.bar(modes, [r["tok_per_s"] for r in runs], color="tab:blue")
        for bar, r in zip(bars, runs):
            ax1.annotate(f"{r['recompute']} recompute\n{r['swap']} swap", (bar.get_x() + bar.get_width() / 2,
                         bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax1.set_ylabel("output tokens / s")
        ax1.set_title("throughput under memory pressure (preemptions)", fontsize=10)
        ax1.margins(y=0.25)
        ax1.grid(axis="y", alpha=0.3)
        xs = range(len(runs))
        ax2.bar([i - 0.2 for i in xs], [r["p50"] for r in runs], 0.4, label="p50")
        ax2.bar([i + 0.2 for i in xs], [r["p99"] for r in runs], 0.4, label="p99")
        ax2.set_xticks(list(xs), modes)
        ax2.set_ylabel("end-to-end latency (s)")
        ax2.set_title("latency, all requests sent at once", fontsize=10)
        ax2.legend(fontsize=8)
        ax2.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    check = C.cpu_check(args.num_threads or 2)
    if args.num_threads is None:
        args.num_threads = 2
        if "WARNING" in check:
            args.num_threads = 1
            check += "\n  -> using 1 thread per process (--num-threads 2 to insist)"
    print(C.machine_line(args.num_threads))
    print(check)
    bw, runs = [], []
    if "1" in args.parts:
        C.Timer.note("part 1: swap bandwidth")
        text, bw = bandwidth(args)
        print("\n" + text)
    if "2" in args.parts:
        trace = make_trace(args)
        print(f"\nmemory pressure: {C.describe_trace(trace)}, seed {args.seed}; greedy, EOS ignored, all sent at once; "
              f"model {args.model or 'SmolLM2-135M-Instruct (default)'}; every server: {args.kv_cache_blocks} "
              f"device KV blocks of 16 tokens, {args.swap_blocks} CPU swap blocks, {args.num_threads} "
              f"thread{'s' if args.num_threads > 1 else ''}")
        runs = [run_mode(args, mode, trace) for mode in args.modes]
        print(pressure_table(runs))
        for line in compare_outputs(runs):
            print(line)
    if args.plot and (bw or runs):
        model = os.path.basename(args.model) if args.model else "SmolLM2-135M"
        plot(args.plot, bw, runs, f"pagedserve swap benchmark, {model} float32, {args.num_requests} requests, "
                                  f"{args.kv_cache_blocks} KV blocks\n"
                                  f"{C.machine_line(args.num_threads).removeprefix('machine: ')}")
    print(f"benchmark wall time: {time.monotonic() - C.Timer.start:.0f} s (server starts included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
