"""Scale-out: throughput and latency of `pagedserve serve` with 1, 2, 3 tensor-parallel ranks and
with 1 and 2 data-plane replicas, with the tensor-parallel communication time per step.

    python bench/scaleout.py [--quick] [--num-requests N] [--num-threads T]

Every configuration serves the same seeded trace over HTTP, all requests at once, greedy with
ignore_eos. SmolLM2 (9 query heads, 3 KV heads) splits over 1 or 3 ranks; 2 ranks run on a tiny
random Llama (4 heads, 2 KV heads, hidden 256, 2 layers) next to its own 1-rank baseline.
Communication time comes from rank 0's `pagedserve_data_plane_tp_comm_seconds_total` (all_reduce of
activations, step plans sent to the other ranks, sampled token ids), divided by its step count.
On a 2-core CPU more ranks than cores only add communication: the figures show its cost, not a
speed-up; on GPUs each rank has its own device.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
import urllib.request

import _common as C  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 short requests per configuration (a smoke run)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per data-plane process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated configurations to run, of smollm-tp1, smollm-tp3, tiny-tp1, tiny-tp2, "
                                               "smollm-dp2 (1 replica is smollm-tp1)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 8
    return args


def make_tiny_model(folder: str) -> str:
    """The tests' tiny random Llama, saved with SmolLM2's tokenizer (the control plane tokenizes)."""
    from transformers import AutoTokenizer

    from shared.config import default_model_path
    from tests.helpers import tiny_llama
    tiny_llama(vocab_size=49152, hidden=256, heads=4, kv_heads=2, layers=2, max_pos=512).save_pretrained(folder)
    tok_dir, gguf = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(tok_dir, gguf_file=gguf).save_pretrained(folder)
    return folder


async def _run_trace(url: str, trace) -> tuple[float, list[float], int]:
    import aiohttp
    latencies = []

    async def one(session, req):
        body = {"prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True}
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data}")
        latencies.append(time.perf_counter() - started)
        return data["usage"]["completion_tokens"]

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await one(s, trace[0])                       # warm-up, not timed
        latencies.clear()
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(s, r) for r in trace))
        return time.perf_counter() - start, latencies, sum(tokens)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _metric_sum(text: str, name: str, label_filter: str = "") -> float:
    total = 0.0
    for labels, value in re.findall(rf"^{name}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$", text, re.M):
        if label_filter in labels:
            total += float(value)
    return total


def run_config(name: str, model: str, trace, args, tp: int = 1, dp: int = 1) -> dict:
    metrics_port = C.free_port()
    extra = ["--model", model, "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp),
             "--data-plane-metrics-port", str(metrics_port), "--kv-cache-blocks", "512",
             "--max-num-batched-tokens", "512"]
    C.progress(f"{name}: starting")
    server = C.start_server(args.num_threads, extra).wait_ready()
    try:
        ports = [metrics_port + i for i in range(dp)]
        before = [_scrape(p) for p in ports]
        C.progress(f"{name}: {len(trace)} requests")
        elapsed, latencies, tokens = asyncio.run(_run_trace(server.url, trace))
        after = [_scrape(p) for p in ports]
        cp_metrics = _scrape(server.port)
    finally:
        server.stop()
    steps = sum(_metric_sum(a, "pagedserve_data_plane_step_duration_seconds_count") -
                _metric_sum(b, "pagedserve_data_plane_step_duration_seconds_count") for a, b in zip(after, before))
    step_s = sum(_metric_sum(a, "pagedserve_data_plane_step_duration_seconds_sum") -
                 _metric_sum(b, "pagedserve_data_plane_step_duration_seconds_sum") for a, b in zip(after, before))
    comm = {kind: sum(_metric_sum(a, "pagedserve_data_plane_tp_comm_seconds_total", f'kind="{kind}"') -
                      _metric_sum(b, "pagedserve_data_plane_tp_comm_seconds_total", f'kind="{kind}"')
                      for a, b in zip(after, before)) for kind in ("all_reduce", "plan", "tokens")}
    per_replica = [_metric_sum(cp_metrics, "pagedserve_requests_received_total", f'replica="{i}"')
                   for i in range(dp)] if dp > 1 else []
    return {"name": name, "requests": len(trace), "tokens": tokens, "seconds": elapsed,
            "tok_s": tokens / elapsed, "p50": C.percentile(latencies, 50), "p90": C.percentile(latencies, 90),
            "steps": steps, "step_ms": 1000 * step_s / max(steps, 1),
            "comm_ms": {k: 1000 * v / max(steps, 1) for k, v in comm.items()}, "per_replica": per_replica}


def main(argv=None) -> int:
    args = parse_args(argv)
    from shared.config import default_model_path
    smollm = default_model_path()
    output_range = (8, 24) if args.quick else (16, 64)
    trace = C.make_trace(args.num_requests, args.seed, 49152, prompt_range=(8, 64), output_range=output_range)
    print(C.machine_line(args.num_threads))
    print(C.describe_trace(trace))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = None
        configs = [("smollm-tp1", "smollm", 1, 1), ("smollm-tp3", "smollm", 3, 1),
                   ("tiny-tp1", "tiny", 1, 1), ("tiny-tp2", "tiny", 2, 1), ("smollm-dp2", "smollm", 1, 2)]
        only = set(args.only.split(",")) if args.only else None
        for name, model, tp, dp in configs:
            if only and name not in only:
                continue
            if model == "tiny" and tiny is None:
                tiny = make_tiny_model(os.path.join(tmp, "tiny"))
            rows.append(run_config(name, smollm if model == "smollm" else tiny, trace, args, tp, dp))
    C.progress_done()
    print("\n| configuration | tokens/s | p50 latency s | p90 latency s | steps | step ms | "
          "comm ms/step (all_reduce + plan + tokens) | requests per replica |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["comm_ms"]
        comm = f"{sum(c.values()):.1f} ({c['all_reduce']:.1f} + {c['plan']:.2f} + {c['tokens']:.2f})" \
            if sum(c.values()) else "-"
        spread = " / ".join(str(int(n)) for n in r["per_replica"]) or "-"
        print(f"| {r['name']} | {r['tok_s']:.1f} | {r['p50']:.2f} | {r['p90']:.2f} | {int(r['steps'])} | "
              f"{r['step_ms']:.1f} | {comm} | {spread} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
