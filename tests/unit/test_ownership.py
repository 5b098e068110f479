"""One control plane per data plane (D5), in one process: a real Worker loop in a thread on a
tcp port, and real DataPlaneClients as control planes."""
import asyncio
import logging
import threading

import pytest

from control_plane.dp_client import DataPlaneClient, DataPlaneDead, DataPlaneRefused
from control_plane.owner_tokens import OwnerTokens
from data_plane.worker import Worker
from shared import protocol as P
from tests.servers import free_port
from tests.helpers import StubRunner


@pytest.fixture
def worker():
    w = Worker(StubRunner(), f"tcp://127.0.0.1:{free_port()}")
    thread = threading.Thread(target=w.serve_forever, daemon=True)
    thread.start()
    yield w
    if thread.is_alive():   # the test did not shut it down: do it as its owner would
        async def stop():
            c = DataPlaneClient(w.listen)
            c.token = w.owner_token
            await c.handshake(5)
            await c.shutdown()
            await asyncio.sleep(0.2)
            c.close()
        asyncio.run(stop())
        thread.join(5)
    assert not thread.is_alive()


def test_a_second_control_plane_is_refused_and_the_first_keeps_its_data_plane(worker, caplog):
    async def run():
        first, second = DataPlaneClient(worker.listen), DataPlaneClient(worker.listen)
        try:
            hs = await first.handshake(5)
            assert hs.owner_token and hs.model_id == "stub"
            with pytest.raises(DataPlaneRefused, match="already serves another control plane"):
                await second.handshake(5, refusal_grace=1.0)
            # its plans, pings and SHUTDOWN are ignored (answered with a refusal, or not at all)
            with pytest.raises(DataPlaneRefused):
                await second.step(P.StepPlan(99), 2)
            with pytest.raises(DataPlaneRefused):
                await second.ping(2)
            await second.shutdown()
            await asyncio.sleep(0.2)
            # the owner is served as before
            assert (await first.step(P.StepPlan(1), 5)).step_id == 1
            await first.ping(5)
            # a reconnect of the owner (a new socket, its token) is the owner again
            first._connect()
            assert (await first.handshake(5)).owner_token == hs.owner_token
            assert (await first.step(P.StepPlan(2), 5)).step_id == 2
        finally:
            first.close()
            second.close()
    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    assert [p.step_id for p in worker.runner.plans] == [1, 2]     # never the second's plan 99
    messages = [r.getMessage() for r in caplog.records]
    assert any("refused a second control plane" in m for m in messages)         # the data plane's side
    assert any("refused" in m and r.name == "pagedserve.control_plane"          # the refused one's side
               for m, r in zip(messages, caplog.records))
    assert sum("ignored" in m and "does not own" in m for m in messages) == 1   # logged once, not per frame


def test_a_restarted_control_plane_takes_over_when_the_owners_link_is_gone(worker):
    async def run():
        first = DataPlaneClient(worker.listen)
        old = (await first.handshake(5)).owner_token
        first.close()   # its process ended: the socket closes, the link goes down
        restarted = DataPlaneClient(worker.listen)
        try:
            hs = await restarted.handshake(10)
            assert hs.owner_token and hs.owner_token != old
            assert (await restarted.step(P.StepPlan(5), 5)).step_id == 5
            await restarted.shutdown()   # the owner's SHUTDOWN is obeyed
            await asyncio.sleep(0.5)
        finally:
            restarted.close()
    asyncio.run(run())


def test_a_restarted_control_plane_takes_over_at_once_and_a_second_live_one_is_refused(worker, tmp_path):
    state = str(tmp_path)

    async def run():
        run1 = OwnerTokens(state)
        old = DataPlaneClient(worker.listen, tokens=run1)
        token = (await old.handshake(5)).owner_token
        assert (await old.step(P.StepPlan(1), 5)).step_id == 1
        # a second control plane on this host while the first runs: it cannot read the token, and
        # the data plane refuses it (no grace: the owner's link is up)
        rival = DataPlaneClient(worker.listen, tokens=OwnerTokens(state))
        assert rival.token is None
        with pytest.raises(DataPlaneRefused, match="already serves another control plane"):
            await rival.handshake(5)   # at the first refusal: the holder of the token lives
        rival.close()
        # the first one dies in a way its link does not show yet (a frozen or cut-off host): its
        # socket stays open, only its process's lock is gone
        run1.close()
        run2 = OwnerTokens(state)
        restarted = DataPlaneClient(worker.listen, tokens=run2)
        assert restarted.token == token
        hs = await restarted.handshake(5, refusal_grace=0.0)   # taken over at the first HELLO
        assert hs.owner_token == token
        assert (await restarted.step(P.StepPlan(2), 5)).step_id == 2
        with pytest.raises(DataPlaneRefused):   # the old socket lost the data plane
            await old.step(P.StepPlan(3), 5)
        old.close()
        restarted.close()
        run2.close()
    asyncio.run(run())
    assert [p.step_id for p in worker.runner.plans] == [1, 2]


def test_a_dropped_link_fails_the_wait_at_once():
    """The data plane's socket closes while a step is in flight: the wait ends at the disconnect,
    not at the step timeout, and the link is reported down (what /health reads)."""
    w = Worker(StubRunner(), f"tcp://127.0.0.1:{free_port()}")

    def serve_then_die():
        while True:
            peer, frame = w.sock.recv_multipart()
            if P.decode(frame)[0] == P.STEP_PLAN:
                w.sock.close(0)   # dies with the plan unanswered
                return
            w.handle(peer, frame)
    thread = threading.Thread(target=serve_then_die, daemon=True)
    thread.start()

    async def run():
        client = DataPlaneClient(w.listen)
        try:
            await client.handshake(5)
            await asyncio.sleep(0.2)
            assert client.link_up
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(DataPlaneDead, match="dropped"):
                await client.step(P.StepPlan(1), 30)
            assert loop.time() - started < 2.0 and not client.link_up
            with pytest.raises(DataPlaneDead, match="is down"):   # nothing is sent down a dead link
                await client.ping(30)
        finally:
            client.close()
    asyncio.run(run())
    thread.join(5)
