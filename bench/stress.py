"""Swap/preemption stress against a live server: many concurrent requests of random lengths, mixed
with parallel sampling and beam search, bounded in count and time.

    python bench/stress.py --url http://127.0.0.1:8000 --reference-url http://127.0.0.1:8001 \\
        --requests 200 --concurrency 200 --duration 300

Every request is deterministic (greedy, seeded samples, beams), so with --reference-url (a server
whose pool is large enough never to preempt) every output is compared token for token. Prints
completed, failed, mismatched, preemptions by kind, swap traffic and blocks leaked; the last line
is the same summary as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time

import aiohttp


def make_bodies(count: int, seed: int, frac_n: float, frac_beam: float, vocab: tuple[int, int]) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        prompt = [rng.randrange(*vocab) for _ in range(rng.randint(4, 40))]
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 24), "return_token_ids": True}
        kind = rng.random()
        if kind < frac_beam:
            body.update(use_beam_search=True, best_of=3, n=2, temperature=0)
        elif kind < frac_beam + frac_n:
            body.update(n=3, temperature=0.8, seed=i, ignore_eos=True)
        else:
            body.update(temperature=0, ignore_eos=True)
        bodies.append(body)
    return bodies


async def run_all(url: str, bodies: list[dict], concurrency: int, deadline: float) -> list:
    """Per body: sorted choice token ids, or an error string."""
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(session, body):
        nonlocal done
        async with sem:
            if time.monotonic() > deadline:
                return "not sent: duration exceeded"
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        return f"HTTP {resp.status}: {data.get('error', {}).get('message')}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}"
            finally:
                done += 1
                print(f"\r{url}: {done}/{len(bodies)}", end="", file=sys.stderr, flush=True)
            return [c["token_ids"] for c in sorted(data["choices"], key=lambda c: c["index"])]

    timeout = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(one(session, b) for b in bodies))
    print(file=sys.stderr)
    return results


async def get_json(url: str, path: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path) as resp:
            return await resp.json()


async def counters(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    values: dict[str, float] = {}
    for name, key in (("pagedserve_num_preemptions_total", "kind"), ("pagedserve_swap_blocks_total", "direction")):
        for match in re.finditer(rf'^{name}{{[^}}]*{key}="(\w+)"[^}}]*}} ([0-9.e+]+)$', text, re.M):
            values[f"{name}:{match.group(1)}"] = float(match.group(2))
    return values


async def wait_idle(url: str, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        kv = await get_json(url, "/debug/kv")
        if not (kv["running"] or kv["waiting"] or kv["swapped"]) or time.monotonic() > end:
            return kv
        await asyncio.sleep(0.2)


async def main_async(args) -> dict:
    bodies = make_bodies(args.requests, args.seed, args.frac_n, args.frac_beam, (args.min_token, args.max_token))
    info = await get_json(args.url, "/version")
    before = await counters(args.url)
    started = time.monotonic()
    results = await run_all(args.url, bodies, args.concurrency, started + args.duration)
    elapsed = time.monotonic() - started
    kv = await wait_idle(args.url)
    after = await counters(args.url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    failed = [r for r in results if isinstance(r, str)]
    mismatched = None
    if args.reference_url:
        reference = await run_all(args.reference_url, bodies, args.concurrency, time.monotonic() + args.duration)
        mismatched = sum(1 for got, want in zip(results, reference)
                         if not isinstance(got, str) and got != want)
    swap_blocks = delta.get("pagedserve_swap_blocks_total:out", 0) + delta.get("pagedserve_swap_blocks_total:in", 0)
    return {
        "requests": len(bodies), "completed": len(bodies) - len(failed), "failed": len(failed),
        "errors": sorted(set(failed))[:5], "mismatched": mismatched, "seconds": round(elapsed, 1),
        "preemption_mode": info.get("preemption_mode"),
        "preemptions_recompute": delta.get("pagedserve_num_preemptions_total:recompute", 0),
        "preemptions_swap": delta.get("pagedserve_num_preemptions_total:swap", 0),
        "swap_blocks": swap_blocks, "swap_bytes": int(swap_blocks * info.get("kv_block_bytes", 0)),
        "blocks_leaked": kv["device_blocks_used"] + kv["cpu_blocks_used"], "integrity": kv["integrity"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--reference-url", default=None, help="a server that never preempts, to compare outputs")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds; requests not sent by then fail")
    ap.add_argument("--frac-n", type=float, default=0.15, help="share of requests with n=3 samples")
    ap.add_argument("--frac-beam", type=float, default=0.15, help="share of beam-search requests (width 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-token", type=int, default=100)
    ap.add_argument("--max-token", type=int, default=40000)
    args = ap.parse_args()
    summary = asyncio.run(main_async(args))
    for key, value in summary.items():
        print(f"{key:>22}: {value}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
