"""CURVE on the ZeroMQ link, with real TCP sockets on loopback: the control plane holding the client
key talks to the data plane; one with another key, or none, gets no handshake and no plan through."""
import asyncio
import os
import threading

import pytest

from control_plane.dp_client import DataPlaneClient, DataPlaneDead
from data_plane.worker import Worker
from shared import curve
from shared import protocol as P
from tests.helpers import StubRunner
from tests.servers import free_port


@pytest.fixture
def keys(tmp_path):
    good, other = str(tmp_path / "keys"), str(tmp_path / "other")
    curve.keygen(good)
    curve.keygen(other)
    # a stranger who knows the data plane's public key, but has a client key pair of its own
    stranger = str(tmp_path / "stranger")
    os.makedirs(stranger)
    for name in ("server.key", "server.key_secret"):
        with open(os.path.join(good, name)) as src, open(os.path.join(stranger, name), "w") as dst:
            dst.write(src.read())
    for name in ("client.key", "client.key_secret"):
        with open(os.path.join(other, name)) as src, open(os.path.join(stranger, name), "w") as dst:
            dst.write(src.read())
    return good, stranger


@pytest.fixture
def curve_worker(keys):
    runner = StubRunner()
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = Worker(runner, address, curve_keys=keys[0])
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    yield address, runner
    # stop it the way the control plane does: an authorized client takes ownership (the test's own
    # clients are gone), then sends SHUTDOWN; a SHUTDOWN from a non-owner is ignored
    client = DataPlaneClient(address, keys[0])

    async def take_over_and_stop():
        await client.handshake(10.0)
        await client.shutdown()
    asyncio.run(take_over_and_stop())
    thread.join(timeout=10)
    client.close()
    assert not thread.is_alive()


async def talk(address, key_dir, timeout=2.0):
    client = DataPlaneClient(address, key_dir)
    try:
        hs = await client.handshake(timeout)
        result = await client.step(P.StepPlan(7), timeout)
        return hs, result
    finally:
        client.close()


def test_the_right_key_gets_plans_through(curve_worker, keys):
    address, runner = curve_worker
    hs, result = asyncio.run(talk(address, keys[0]))
    assert hs.model_id == "stub" and result.step_id == 7 and result.error is None
    assert [p.step_id for p in runner.plans] == [7]


@pytest.mark.parametrize("who", ["stranger", "plain"])
def test_a_wrong_key_or_no_key_gets_nothing(curve_worker, keys, who):
    address, runner = curve_worker
    with pytest.raises(DataPlaneDead):
        asyncio.run(talk(address, keys[1] if who == "stranger" else None, timeout=1.5))
    assert runner.plans == []
    # the data plane is unharmed: the right key still works
    assert asyncio.run(talk(address, keys[0]))[1].step_id == 7
