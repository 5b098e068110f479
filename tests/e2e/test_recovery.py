"""A data plane killed (SIGKILL) or hung (SIGSTOP) under load: the control plane notices, restarts
it, re-queues every in-flight request for recompute, and all complete exactly as undisturbed."""
import asyncio
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from tests.e2e.client import TIMEOUT, get, metric_value
from tests.servers import Server

pytestmark = pytest.mark.slow
BODIES = [{"prompt": f"Request number {i} asks for a long answer", "max_tokens": 400, "ignore_eos": True,
           "temperature": 0, "return_token_ids": True} for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server("recovery", ["--model", tiny_model_dir, "--num-threads", "1", "--step-timeout", "3",
                            "--kv-cache-blocks", "512"], str(tmp_path_factory.mktemp("recovery")))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def data_plane_pid(server) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, f"expected one data-plane child, found {pids}"
    return pids[0]


async def send_all(url):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async def one(body):
            async with session.post(url + "/v1/completions", json=body) as resp:
                return resp.status, await resp.json()
        return await asyncio.gather(*(one(b) for b in BODIES))


async def decoding(url):
    """Returns once every request is in the running batch: the fault must land mid-decode, however fast the machine serves the tiny model (a fixed sleep did not, once the
    CPU kernels made 120 tokens take under a second)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(400):
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            if metric_value(text, "pagedserve_num_requests_running") == len(BODIES):
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the requests never started decoding")


def run_with_fault(server, sig):
    async def run():
        task = asyncio.create_task(send_all(server.url))
        await decoding(server.url)
        victim = data_plane_pid(server)
        os.kill(victim, sig)
        results = await task
        return victim, results
    return asyncio.run(run())


@pytest.fixture(scope="module")
def undisturbed(server):
    results = asyncio.run(send_all(server.url))
    assert all(status == 200 for status, _ in results)
    return [d["choices"][0]["token_ids"] for _, d in results]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_requests_survive_a_data_plane_fault(server, undisturbed, sig):
    started = time.monotonic()
    victim, results = run_with_fault(server, sig)
    assert [status for status, _ in results] == [200] * len(BODIES), results
    assert [d["choices"][0]["token_ids"] for _, d in results] == undisturbed
    assert data_plane_pid(server) != victim             # a new data plane serves
    assert get(server.url, "/health")[0] == 200
    log = server.log_all()
    assert "re-queued for recompute" in log and "restarting it" in log
    assert time.monotonic() - started < 120
    assert not os.path.exists(f"/proc/{victim}") or "zombie" in open(f"/proc/{victim}/status").read().lower()
