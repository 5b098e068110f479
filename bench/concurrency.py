"""Tokens/s of N concurrent greedy requests through the REST API (a real HTTP client).

    python bench/concurrency.py --url http://127.0.0.1:8000 --requests 32 --max-tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some tips for learning a new language.",
    "What are the main causes of the seasons on Earth?",
    "Describe the water cycle in a few sentences.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Summarize the plot of a detective novel you invent.",
]


async def one(session, url, model, i, max_tokens, done):
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)] + f" (variant {i})", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
    done.append(data["usage"]["completion_tokens"])
    print(f"\r{len(done)} requests done", end="", file=sys.stderr, flush=True)
    return data["usage"]["completion_tokens"]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{args.url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        done: list[int] = []
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(session, args.url, model, i, args.max_tokens, done)
                                        for i in range(args.requests)))
        elapsed = time.perf_counter() - start
    print(file=sys.stderr)
    print(f"{args.requests} concurrent requests, {sum(tokens)} output tokens in {elapsed:.1f} s: "
          f"{sum(tokens) / elapsed:.1f} output tokens/s")


if __name__ == "__main__":
    asyncio.run(main())
