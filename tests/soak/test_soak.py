"""Soak: mixed valid and invalid traffic with random client disconnects against real processes
(tiny random model, a 24-block KV pool that preempts and swaps). Valid requests never get a 5xx,
invalid ones always get a 4xx, no block leaks, and the resident memory of both processes stays
bounded. PAGEDSERVE_SOAK_SECONDS sets the length (default 60: the short version CI runs)."""
import asyncio
import os
import random
import subprocess
import time

import aiohttp
import pytest

from tests.servers import Server

pytestmark = [pytest.mark.soak, pytest.mark.slow]
SECONDS = float(os.environ.get("PAGEDSERVE_SOAK_SECONDS", "60"))
CLIENTS = 6
RSS_GROWTH_LIMIT_MIB = 64   # after warm-up, per process


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir, tmp_path_factory):
    server = Server("soak", ["--model", tiny_model_dir, "--num-threads", "1", "--kv-cache-blocks", "24",
                             "--swap-blocks", "64", "--max-num-seqs", "16"], str(tmp_path_factory.mktemp("soak")))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def data_plane_pid(server) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, pids
    return pids[0]


def valid_body(rng: random.Random) -> tuple[str, dict]:
    common = {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99),
              "n": rng.choice([1, 1, 1, 2]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Say something " * rng.randint(1, 5)}]}
    prompt = rng.choice(["Once upon a time", "The weather today", [rng.randint(5, 4000) for _ in range(rng.randint(1, 60))]])
    return "/v1/completions", {**common, "prompt": prompt}


INVALID = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokns": 5}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "suffix": "end"}'),
    ("/v1/completions", b'{"prompt": "hi", "n": 99}'),
    ("/v1/completions", b'{"prompt": [1, 2, 99999999]}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}'),
    ("/v1/completions", b'\x00\xff garbage'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", "extra": 1}]}'),
    ("/v1/chat/completions", b'{"messages": []}'),
]


async def client_loop(url: str, rng: random.Random, until: float, tally: dict) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        while time.monotonic() < until:
            kind = rng.choices(["valid", "stream", "invalid", "disconnect", "impatient", "deadline"],
                               [35, 15, 20, 12, 10, 8])[0]
            path, body = valid_body(rng)
            try:
                if kind == "invalid":
                    path, raw = rng.choice(INVALID)
                    async with session.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                        data = await r.json()
                        assert 400 <= r.status < 500 and data["error"]["message"], (raw, r.status, data)
                elif kind in ("valid", "deadline"):
                    if kind == "deadline":
                        body = {**body, "timeout": rng.uniform(0.01, 0.5)}
                    async with session.post(url + path, json=body) as r:
                        data = await r.json()
                        ok = (200, 504) if kind == "deadline" else (200,)
                        assert r.status in ok, (body, r.status, data)
                        if r.status == 200:
                            assert data["usage"]["completion_tokens"] >= 1
                elif kind == "stream":
                    async with session.post(url + path, json={**body, "stream": True}) as r:
                        assert r.status == 200, (body, r.status, await r.text())
                        lines = [line async for line in r.content if line.strip()]
                        assert lines[-1].strip() == b"data: [DONE]"
                elif kind == "disconnect":
                    async with session.post(url + path, json={**body, "max_tokens": 200, "ignore_eos": True,
                                                              "n": 1, "stream": True}) as r:
                        assert r.status == 200
                        for _ in range(rng.randint(1, 4)):
                            await r.content.readline()
                    # leaving the block closes the connection mid-stream
                else:   # impatient: gives up before the answer
                    async def whole_answer():
                        async with session.post(url + path, json={**body, "max_tokens": 200, "ignore_eos": True,
                                                                  "n": 1}) as r:
                            assert r.status == 200, (body, r.status)
                            await r.read()
                    try:
                        await asyncio.wait_for(whole_answer(), rng.uniform(0.02, 0.3))
                    except asyncio.TimeoutError:
                        pass
                tally[kind] = tally.get(kind, 0) + 1
            except AssertionError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise AssertionError(f"{kind} request failed at the transport level: {exc!r}") from exc


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as r:
            return await r.json()


def test_soak_mixed_traffic_no_5xx_no_leaks_bounded_memory(soak_server, record_property):
    server = soak_server
    cp_pid, dp_pid = server.proc.pid, data_plane_pid(server)
    rngs = [random.Random(1000 + i) for i in range(CLIENTS)]
    tally: dict = {}
    warmup = max(10.0, SECONDS * 0.25)

    async def run():
        start = time.monotonic()
        tasks = [asyncio.create_task(client_loop(server.url, rng, start + SECONDS, tally)) for rng in rngs]
        await asyncio.sleep(warmup)
        after_warmup = (rss_mib(cp_pid), rss_mib(dp_pid))
        peak = list(after_warmup)
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=2.0)
            peak = [max(peak[0], rss_mib(cp_pid)), max(peak[1], rss_mib(dp_pid))]
        for t in tasks:
            t.result()    # re-raises a client's assertion
        deadline = time.monotonic() + 30
        while True:
            kv = await get_json(server.url + "/debug/kv")
            idle = kv["running"] == kv["waiting"] == kv["swapped"] == 0
            if (idle and kv["device_blocks_used"] == 0 and kv["cpu_blocks_used"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return after_warmup, peak, (rss_mib(cp_pid), rss_mib(dp_pid)), kv
    after_warmup, peak, end, kv = asyncio.run(run())
    growth = [end[i] - after_warmup[i] for i in range(2)]
    summary = (f"soak {SECONDS:.0f}s, {sum(tally.values())} requests {tally}; RSS MiB control plane "
               f"{after_warmup[0]:.1f} -> {end[0]:.1f} (peak {peak[0]:.1f}), data plane {after_warmup[1]:.1f} -> "
               f"{end[1]:.1f} (peak {peak[1]:.1f}); preemptions {kv['preemptions']}")
    print(summary)
    record_property("soak", summary)
    assert kv["device_blocks_used"] == 0 and kv["cpu_blocks_used"] == 0, kv
    assert kv["running"] == kv["waiting"] == kv["swapped"] == 0 and kv["integrity"] == "ok", kv
    assert all(tally.get(k, 0) > 0 for k in ("valid", "stream", "invalid", "disconnect", "impatient")), tally
    assert all(g < RSS_GROWTH_LIMIT_MIB for g in growth), summary
    assert server.proc.poll() is None and "Traceback" not in server.log_all()
