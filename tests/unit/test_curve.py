"""CURVE on the ZeroMQ link, with real TCP sockets on loopback: the control plane holding the client
key talks to the data plane; one with another key, or none, gets no handshake and no plan through."""
import asyncio
import os
import subprocess
import sys
import threading

import pytest

from control_plane.dp_client import DataPlaneClient, DataPlaneDead
from data_plane.worker import Worker
from shared import curve
from shared import protocol as P
from tests.servers import free_port
from tests.unit.test_worker import StubRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    # stop it the way the control plane does: a SHUTDOWN from an authorized client
    client = DataPlaneClient(address, keys[0])
    asyncio.run(client.shutdown())
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


def test_keygen_writes_zmq_certificates_and_never_overwrites(tmp_path):
    folder = str(tmp_path / "k")
    cmd = [sys.executable, "-m", "control_plane.cli", "keygen", folder]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(folder)) == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert oct(os.stat(os.path.join(folder, "server.key_secret")).st_mode & 0o777) == "0o600"
    server, client = curve.load_server_keys(folder), curve.load_client_keys(folder)
    assert client.server_public == server.public and server.authorized_clients == {client.public}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 2 and "exists already" in again.stderr


def test_data_plane_process_refuses_a_public_address_without_keys(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "control_plane.cli", "data-plane", "--model", tiny_model_dir,
                          "--listen", f"tcp://0.0.0.0:{free_port()}", "--metrics-port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--curve-keys" in out.stderr and "--insecure" in out.stderr and "Traceback" not in out.stderr
