"""The control plane's link waits on its ZeroMQ socket's descriptor in the event loop (dp_client.py).
That descriptor is edge-triggered: a wake-up lost is a reply seen only when the wait's time slice ends.
Here the slice is a minute, so a lost wake-up fails the test by its timeout, not by a timing."""
import asyncio
import threading

import pytest
import zmq

from control_plane import dp_client
from control_plane.dp_client import DataPlaneClient
from data_plane.worker import Worker
from shared import protocol as P
from tests.helpers import StubRunner
from tests.servers import free_port


@pytest.fixture
def link(monkeypatch):
    monkeypatch.setattr(dp_client, "POLL_SLICE_SECONDS", 60.0)
    worker = Worker(StubRunner(), f"tcp://127.0.0.1:{free_port()}")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    client = DataPlaneClient(worker.listen)
    yield client
    async def stop():
        await client.shutdown()
        await asyncio.sleep(0.2)
    asyncio.run(stop())
    client.close()
    thread.join(5)
    assert not thread.is_alive()


def test_each_reply_wakes_the_wait_for_it(link):
    async def run():
        await link.handshake(10)
        # as overlap sends: the plan of step N + 1 goes out before the result of step N is awaited
        await link.send_plan(P.StepPlan(1))
        for step_id in range(2, 302):
            await link.send_plan(P.StepPlan(step_id))
            assert (await link.result_of(step_id - 1, 60)).step_id == step_id - 1
        assert (await link.result_of(301, 60)).step_id == 301
        for _ in range(50):
            await link.ping(60)
    asyncio.run(asyncio.wait_for(run(), 30))


def test_waits_side_by_side_are_all_woken(link):
    async def run():
        await link.handshake(10)
        waits = [asyncio.create_task(link._ready(zmq.POLLIN, 60)) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waits)   # nothing has come yet
        await link._send(P.encode(P.PING))       # its PONG makes the socket readable
        assert await asyncio.gather(*waits) == [True, True, True]
        assert P.decode(link.sock.recv(zmq.NOBLOCK))[0] == P.PONG
        assert not await link._ready(zmq.POLLIN, 0.05)   # and a wait with nothing to come ends when it should
    asyncio.run(asyncio.wait_for(run(), 30))
