"""Access and overload on a real server (tiny random model): API keys, a bounded waiting queue,
and clients that disconnect mid-stream."""
import asyncio
import time

import aiohttp
import pytest

from tests.e2e.client import metric_value
from tests.servers import Server

pytestmark = pytest.mark.slow
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    server = Server("guarded", ["--model", tiny_model_dir, "--num-threads", "1", "--api-key", KEY,
                                "--max-waiting", "2", "--max-num-seqs", "2", "--kv-cache-blocks", "256",
                                "--max-n", "2"],
                    str(tmp_path_factory.mktemp("access")))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


async def fetch(method, url, headers=None, json=None):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, headers=headers or {}, json=json) as resp:
            return resp.status, await resp.text(), dict(resp.headers)


def test_api_key_is_required_except_for_probes(guarded):
    async def run():
        return [await fetch("GET", guarded.url + "/v1/models"),
                await fetch("GET", guarded.url + "/v1/models", {"Authorization": "Bearer wrong"}),
                await fetch("GET", guarded.url + "/v1/models", AUTH),
                await fetch("GET", guarded.url + "/health"),
                await fetch("GET", guarded.url + "/metrics")]
    (s1, t1, _), (s2, _, _), (s3, _, _), (s4, _, _), (s5, _, _) = asyncio.run(run())
    assert (s1, s2, s3, s4, s5) == (401, 401, 200, 200, 200)
    assert "invalid_api_key" in t1


def test_overload_gets_503_with_retry_after_and_accepted_requests_complete(guarded):
    body = {"prompt": "Tell me a long story", "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def run():
        return await asyncio.gather(*(fetch("POST", guarded.url + "/v1/completions", AUTH, body)
                                      for _ in range(12)))
    results = asyncio.run(run())
    statuses = sorted(status for status, _, _ in results)
    assert 503 in statuses and 200 in statuses, statuses
    for status, text, headers in results:
        if status == 503:
            assert headers["Retry-After"] == "5" and "overloaded" in text
        else:
            assert status == 200 and '"completion_tokens": 40' in text


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(guarded):
    body = {"prompt": "Count to a thousand", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}

    async def run():
        _, before, _ = await fetch("GET", guarded.url + "/metrics")
        async with aiohttp.ClientSession() as session:
            async with session.post(guarded.url + "/v1/completions", headers=AUTH, json=body) as resp:
                await resp.content.readline()          # the first event arrived: it is running
                _, kv, _ = await fetch("GET", guarded.url + "/debug/kv", AUTH)
                assert '"running": 1' in kv
        # the connection is closed here, long before 400 tokens
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            _, kv, _ = await fetch("GET", guarded.url + "/debug/kv", AUTH)
            if '"device_blocks_used": 0' in kv and '"running": 0' in kv:
                break
            await asyncio.sleep(0.2)
        _, after, _ = await fetch("GET", guarded.url + "/metrics")
        return kv, before, after
    kv, before, after = asyncio.run(run())
    assert '"device_blocks_used": 0' in kv and '"integrity": "ok"' in kv, kv
    aborted = metric_value(after, "pagedserve_request_success_total", finished_reason="abort") - \
        metric_value(before, "pagedserve_request_success_total", finished_reason="abort")
    assert aborted == 1
    assert metric_value(after, "pagedserve_generation_tokens_total") - \
        metric_value(before, "pagedserve_generation_tokens_total") < 400


def test_n_and_best_of_beyond_max_n_get_a_clear_400(guarded):
    async def run():
        body = {"prompt": "hi", "max_tokens": 2}
        return [await fetch("POST", guarded.url + "/v1/completions", AUTH, {**body, **extra})
                for extra in ({"n": 3}, {"best_of": 3}, {"n": 2, "temperature": 0.5})]
    (s1, t1, _), (s2, t2, _), (s3, t3, _) = asyncio.run(run())
    assert (s1, s2, s3) == (400, 400, 200), (t1, t2, t3)
    for text, name in ((t1, "n"), (t2, "best_of")):
        assert f'"param": "{name}"' in text and "limit of 2" in text and "--max-n" in text
