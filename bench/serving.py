"""Online serving: Poisson arrivals at several request rates against the REST endpoint, streamed.

    python bench/serving.py                              # starts a server; 0.25, 0.5, 1, 2 req/s
    python bench/serving.py --url http://127.0.0.1:8000  # a server that is already running
    python bench/serving.py --quick                      # CI-sized

Each rate sends --num-prompts requests of the seeded trace (_common.WORKLOADS: prompt and
output lengths like the paper's Alpaca and ShareGPT, scaled to a CPU), greedy with EOS ignored,
as streaming completions (server-sent events) through a real HTTP client, and measures per
request: TTFT (send to first token), TPOT ((end - first token) / (tokens - 1)), ITL (gaps between
token events) and end-to-end latency; per rate: request and token throughput and goodput, the
requests per second that met both SLOs (--slo-ttft, --slo-tpot). Latency against rate is
plotted to docs/serving.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

VOCAB_SIZE = 49152
DEFAULT_PLOT = os.path.join(C.ROOT, "docs", "serving.png")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; default: start one")
    ap.add_argument("--num-threads", type=int, default=2, help="data-plane threads of a server started here")
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="requests per second, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", default="mixed", choices=["mixed", *sorted(C.WORKLOADS)])
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds, for goodput")
    ap.add_argument("--slo-tpot", type=float, default=0.3, help="seconds per output token, for goodput")
    ap.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path ('' for none)")
    ap.add_argument("--quick", action="store_true", help="rates 1 and 4, 6 requests of 8 + 8 tokens each")
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.num_prompts = "1,4", 6
    args.rates = [float(r) for r in args.rates.split(",") if r]
    return args


@dataclass
class Record:
    sent: float
    first: float | None = None
    end: float | None = None
    num_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def e2e(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0


async def stream_one(session, url: str, model: str, req: C.TraceRequest) -> Record:
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    rec = Record(time.perf_counter())
    last = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return rec
        async for raw in resp.content:   # one server-sent event per line
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            for choice in json.loads(payload).get("choices", []):
                if choice.get("error"):
                    rec.error = choice["error"]
                tokens = choice.get("token_ids") or []
                if tokens:
                    now = time.perf_counter()
                    if rec.first is None:
                        rec.first = now
                    else:
                        rec.itls.append(now - last)
                    last = now
                    rec.num_tokens += len(tokens)
    rec.end = time.perf_counter()
    if rec.error is None and rec.num_tokens != req.output_len:
        rec.error = f"{rec.num_tokens} tokens streamed, {req.output_len} asked"
    return rec


async def run_rate(session, url: str, model: str, trace, rate: float, rng: random.Random):
    """Sends the trace with exponential gaps of mean 1/rate; returns the records and the duration."""
    done = 0

    async def send_at(offset: float, req):
        nonlocal done
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        rec = await stream_one(session, url, model, req)
        done += 1
        C.progress(f"rate {rate:g} req/s: {done}/{len(trace)} requests done")
        return rec

    offsets, t = [], 0.0
    for _ in trace:
        offsets.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()
    records = await asyncio.gather(*(send_at(o, r) for o, r in zip(offsets, trace)))
    C.progress_done()
    return records, max(r.end or r.sent for r in records) - start


def summarize(records: list[Record], duration: float, args) -> dict:
    ok = [r for r in records if r.error is None and r.first is not None]
    good = [r for r in ok if r.ttft <= args.slo_ttft and r.tpot <= args.slo_tpot]
    s = {"completed": len(ok), "failed": len(records) - len(ok), "duration": duration,
         "req_per_s": len(ok) / duration, "tok_per_s": sum(r.num_tokens for r in ok) / duration,
         "goodput": len(good) / duration, "errors": sorted({r.error for r in records if r.error})[:3]}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok if r.num_tokens > 1]),
                         ("itl", [x for r in ok for x in r.itls]), ("e2e", [r.e2e for r in ok])):
        s[name] = (C.mean(values), C.percentile(values, 50), C.percentile(values, 99))
    return s


def print_table(rows: list[tuple[float, dict]], args) -> None:
    print(f"\nlatencies as mean / p50 / p99; goodput: requests/s with TTFT <= {args.slo_ttft:g} s and "
          f"TPOT <= {1000 * args.slo_tpot:g} ms")
    print(f"{'rate':>6} {'done':>5} {'req/s':>6} {'tok/s':>7} {'TTFT s':>20} {'TPOT ms':>20} "
          f"{'ITL ms':>20} {'E2E s':>20} {'goodput':>8}")
    for rate, s in rows:
        def trio(key, scale):
            return "/".join(f"{scale * v:.{2 if scale == 1 else 0}f}" for v in s[key])
        print(f"{rate:>6g} {s['completed']:>5} {s['req_per_s']:>6.2f} {s['tok_per_s']:>7.1f} "
              f"{trio('ttft', 1):>20} {trio('tpot', 1000):>20} {trio('itl', 1000):>20} {trio('e2e', 1):>20} "
              f"{s['goodput']:>8.2f}")
        if s["failed"]:
            print(f"       {s['failed']} requests failed: {'; '.join(s['errors'])}")


def plot(rows: list[tuple[float, dict]], args, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")   # no display on a server
    import matplotlib.pyplot as plt
    rates = [r for r, _ in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("ttft", "time to first token (s)", 1), ("tpot", "time per output token (ms)", 1000),
              ("e2e", "end-to-end latency (s)", 1))
    for ax in axes.flat:   # rates usually double from one to the next
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
    for ax, (key, label, scale) in zip(axes.flat, panels):
        for index, name, style in ((0, "mean", "o-"), (1, "p50", "s--"), (2, "p99", "^:")):
            ax.plot(rates, [scale * s[key][index] for _, s in rows], style, label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    ax.plot(rates, [s["req_per_s"] for _, s in rows], "o-", label="throughput")
    ax.plot(rates, [s["goodput"] for _, s in rows], "s--",
            label=f"goodput (TTFT<={args.slo_ttft:g}s, TPOT<={1000 * args.slo_tpot:g}ms)")
    ax.plot(rates, rates, ":", color="gray", label="offered")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {args.plot}")


async def run_all(url: str, args) -> list[tuple[float, dict]]:
    import aiohttp
    rows = []
    connector = aiohttp.TCPConnector(limit=0)   # no client-side cap on requests in flight
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as s:
        async with s.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        warm = C.make_trace(1, args.seed + 999, VOCAB_SIZE, args.workload, (8, 8), (2, 2))[0]
        await stream_one(s, url, model, warm)   # warm-up, not measured
        for k, rate in enumerate(args.rates):
            # the same lengths at every rate, but new token ids: a prompt sent again would hit the prefix cache
            trace = make_trace(args)
            tokens = random.Random(args.seed * 1000 + k + 1)
            for r in trace:
                r.prompt_ids = [tokens.randrange(C.FIRST_ORDINARY_TOKEN, VOCAB_SIZE) for _ in r.prompt_ids]
            records, duration = await run_rate(s, url, model, trace, rate, random.Random(args.seed + k))
            rows.append((rate, summarize(records, duration, args)))
    return rows


def make_trace(args) -> list[C.TraceRequest]:
    lengths = ((8, 8), (8, 8)) if args.quick else ()
    return C.make_trace(args.num_prompts, args.seed, VOCAB_SIZE, args.workload, *lengths)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(C.machine_line(args.num_threads) + ("" if args.url is None else " (bench client; server given by --url)"))
    print(C.cpu_check(args.num_threads))
    print(f"per rate: {C.describe_trace(make_trace(args))}, workload {args.workload}, seed {args.seed} "
          "(the same lengths at every rate, new prompt tokens, new Poisson arrivals)")
    server = None
    url = args.url
    if url is None:
        server = C.start_server(args.num_threads)
        url = server.url
    try:
        if server is not None:
            C.Timer.note("starting pagedserve")
            server.wait_ready()
        version = C.get_json(url + "/version")
        print(f"server: {url}, pagedserve {version.get('version')}, {version.get('device')}, "
              f"{version.get('dtype')}, {version.get('num_device_blocks')} blocks of {version.get('block_size')}")
        rows = asyncio.run(run_all(url, args))
    finally:
        if server is not None:
            server.stop()
    print_table(rows, args)
    if args.plot:
        plot(rows, args, f"pagedserve, SmolLM2-135M float32, {args.num_prompts} requests per rate\n"
                         f"{C.machine_line(args.num_threads).removeprefix('machine: ')}")
    print(f"benchmark wall time: {time.monotonic() - C.Timer.start:.0f} s (server start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
