"""Per-request deadlines and graceful shutdown on real processes (tiny random model).

Deadlines: a request past its deadline is aborted at the next step, its blocks are freed, it is
counted with finish reason "timeout"; a non-streamed client gets 504, a streamed one a last chunk
per choice with finish_reason "timeout". Shutdown: on SIGTERM the server answers 503 to new
requests, lets those in flight finish within --shutdown-grace or aborts them with a clean answer,
stops its data plane and exits 0."""
import asyncio
import json
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from tests.e2e.client import USAGE_CHUNK, metric_value, sse_events
from tests.servers import Server

pytestmark = pytest.mark.slow
LONG = {"prompt": "Write a very long story", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def started(heavier_model_dir, tmp_path_factory):
    """Two servers loading at once: one for deadlines that is then shut down with no grace period
    (its requests are aborted at once), and one that drains on shutdown. Both serve the heavier model:
    long requests must outlast the deadlines, and a drain the probe sent during it, on any machine."""
    tmp = str(tmp_path_factory.mktemp("lifecycle"))
    common = ["--model", heavier_model_dir, "--num-threads", "1", "--kv-cache-blocks", "256"]
    servers = {"deadline": Server("deadline", common + ["--request-timeout", "2", "--shutdown-grace", "0"], tmp),
               "drain": Server("drain", common + ["--shutdown-grace", "60"], tmp)}
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


async def fetch(method, url, json_body=None):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=json_body) as resp:
            return resp.status, await resp.text()


async def stream_lines(url, body):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={**USAGE_CHUNK, **body, "stream": True}) as resp:
            assert resp.status == 200
            return [line.decode() async for line in resp.content]


async def wait_idle(url, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = json.loads((await fetch("GET", url + "/debug/kv"))[1])
        if (kv["device_blocks_used"] == 0 and kv["running"] == kv["waiting"] == kv["swapped"] == 0) \
                or time.monotonic() > deadline:
            return kv
        await asyncio.sleep(0.1)


def test_a_request_past_its_deadline_gets_504_and_frees_its_blocks(started):
    server = started["deadline"].wait_ready()

    async def run():
        before = (await fetch("GET", server.url + "/metrics"))[1]
        short = asyncio.create_task(fetch("POST", server.url + "/v1/completions",
                                          {"prompt": "Hello", "max_tokens": 8, "temperature": 0}))
        t0 = time.monotonic()
        status, text = await fetch("POST", server.url + "/v1/completions", {**LONG, "timeout": 0.5})
        elapsed = time.monotonic() - t0
        kv = await wait_idle(server.url)
        after = (await fetch("GET", server.url + "/metrics"))[1]
        return status, json.loads(text), elapsed, await short, kv, before, after
    status, data, elapsed, (short_status, short_text), kv, before, after = asyncio.run(run())
    assert status == 504, data
    assert data["error"]["code"] == "request_timeout" and data["error"]["param"] == "timeout"
    assert "deadline" in data["error"]["message"]
    assert 0.5 <= elapsed < 1.8      # aborted at the next step, not at the end of 480 tokens
    assert short_status == 200 and json.loads(short_text)["usage"]["completion_tokens"] == 8
    assert kv["device_blocks_used"] == 0 and kv["integrity"] == "ok", kv
    timeouts = metric_value(after, "pagedserve_request_success_total", finished_reason="timeout") - \
        metric_value(before, "pagedserve_request_success_total", finished_reason="timeout")
    assert timeouts == 1


def test_the_server_limit_caps_a_longer_body_timeout(started):
    server = started["deadline"].wait_ready()
    t0 = time.monotonic()
    # 6 samples of 480 tokens: far more work than the 2 s cap on the heavier model (the tiny one's steps came
    # within it once its float32 products went through the panels)
    body = {**LONG, "n": 6, "temperature": 1.0, "seed": 3, "timeout": 100}   # 6 x 480 fits the 256-block pool
    status, text = asyncio.run(fetch("POST", server.url + "/v1/completions", body))
    assert status == 504 and "request_timeout" in text
    assert 2.0 <= time.monotonic() - t0 < 4.0     # --request-timeout 2


def test_a_streamed_request_past_its_deadline_ends_with_finish_reason_timeout(started):
    server = started["deadline"].wait_ready()
    events = sse_events(asyncio.run(stream_lines(server.url, {**LONG, "n": 2, "temperature": 1.0, "seed": 1,
                                                              "timeout": 0.5})))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    finals = {c["index"]: c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]}
    assert finals == {0: "timeout", 1: "timeout"}
    assert 0 < events[-2]["usage"]["completion_tokens"] < 2 * LONG["max_tokens"]
    assert asyncio.run(wait_idle(server.url))["device_blocks_used"] == 0


def data_plane_pid(server) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, f"expected one data-plane child, found {pids}"
    return pids[0]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def shut_down_under_load(server, body, probe: bool):
    """Two streamed and two plain requests in flight, then SIGTERM; returns what every client saw, the
    answers to a request and a health probe sent during the drain, and the data plane's pid."""
    async def run():
        streams = [asyncio.create_task(stream_lines(server.url, body)) for _ in range(2)]
        plain = [asyncio.create_task(fetch("POST", server.url + "/v1/completions", body)) for _ in range(2)]
        deadline = time.monotonic() + 20
        while json.loads((await fetch("GET", server.url + "/debug/kv"))[1])["running"] < 4:
            assert time.monotonic() < deadline, "the requests never ran"
            await asyncio.sleep(0.05)
        child = data_plane_pid(server)
        server.proc.send_signal(signal.SIGTERM)
        during = health = None
        if probe:    # while it drains (with no grace period it is gone at once)
            await asyncio.sleep(0.2)
            during = await fetch("POST", server.url + "/v1/completions", {"prompt": "late", "max_tokens": 2})
            health = await fetch("GET", server.url + "/health")
        return ([sse_events(s) for s in await asyncio.gather(*streams)], await asyncio.gather(*plain),
                during, health, child)
    return asyncio.run(run())


def assert_clean_exit(server, child):
    assert server.proc.wait(timeout=30) == 0
    assert gone(child), "the data plane still runs"
    log = server.log_all()
    assert "Traceback" not in log, log[-3000:]
    assert "leaked" not in log, log[-3000:]   # extension objects left unfreed at the data plane's exit
    return log


def test_sigterm_lets_requests_in_flight_finish(started):
    server = started["drain"].wait_ready()
    body = {"prompt": "Count slowly", "max_tokens": 80, "ignore_eos": True, "temperature": 0}
    streams, plain, during, health, child = shut_down_under_load(server, body, probe=True)
    assert during[0] == 503 and "shutting_down" in during[1]
    assert health[0] == 503
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 80
        assert [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]] == ["length"]
    for status, text in plain:
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 80
    log = assert_clean_exit(server, child)
    assert "every request in flight finished" in log


def test_sigterm_past_the_grace_period_aborts_with_a_clean_answer(started):
    server = started["deadline"].wait_ready()   # the deadline tests ran on it first
    streams, plain, _, _, child = shut_down_under_load(server, LONG, probe=False)
    for events in streams:
        assert events[-1] == "[DONE]"
        last = [c for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
        assert len(last) == 1 and last[0]["finish_reason"] == "abort" and "shut down" in last[0]["error"]
        assert events[-2]["usage"]["completion_tokens"] < LONG["max_tokens"]
    for status, text in plain:
        err = json.loads(text)["error"]
        assert status == 503 and err["code"] == "shutting_down" and "send it again" in err["message"]
    log = assert_clean_exit(server, child)
    assert "aborting 4 requests that did not finish in time" in log
    assert not os.path.exists(f"/proc/{server.proc.pid}")
