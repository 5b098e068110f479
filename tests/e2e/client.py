"""A small real HTTP client for the tests (aiohttp)."""
from __future__ import annotations

import asyncio
import json

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=600)


async def post(session, url, path, body, raw: bytes | None = None):
    kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
    async with session.post(url + path, **kwargs) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def post_many(url: str, path: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Sends all bodies concurrently; returns (status, json) in order."""
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            results = await asyncio.gather(*(post(session, url, path, b) for b in bodies))
            return [(status, data) for status, data, _ in results]
    return asyncio.run(run())


def post_one(url: str, path: str, body: dict | None = None, raw: bytes | None = None):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await post(session, url, path, body, raw)
    return asyncio.run(run())


def get(url: str, path: str):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(url + path) as resp:
                return resp.status, await resp.text()
    return asyncio.run(run())


# the usage chunk the assertions read (OpenAI sends it only when asked); a body may override it
USAGE_CHUNK = {"stream_options": {"include_usage": True}}


def stream(url: str, path: str, body: dict) -> tuple[dict, list[str]]:
    """Raw SSE lines of a streaming request, and the response headers."""
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(url + path, json={**USAGE_CHUNK, **body, "stream": True}) as resp:
                lines = [line.decode() async for line in resp.content]
                return dict(resp.headers), lines
    return asyncio.run(run())


def sse_events(lines: list[str]) -> list:
    """Parsed `data:` payloads; "[DONE]" kept as a string."""
    events = []
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric_value(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total
