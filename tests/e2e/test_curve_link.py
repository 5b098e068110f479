"""CURVE between real processes: a data plane on tcp://127.0.0.1 with keys serves the control
plane that holds the client key; a peer with another client key gets no handshake at all."""
import asyncio
import os

import pytest

from control_plane.dp_client import DataPlaneClient, DataPlaneDead
from shared import curve
from shared import protocol as P
from tests.e2e.client import post_one

pytestmark = pytest.mark.slow


def test_the_control_plane_with_the_key_is_served(curve_split):
    status, data, _ = post_one(curve_split.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 5})
    assert status == 200 and data["usage"]["completion_tokens"] == 5
    assert "CURVE on" in curve_split.dp_log()


def test_a_peer_with_another_key_gets_nothing(curve_split, tmp_path):
    other = str(tmp_path / "other")
    curve.keygen(other)
    # it knows the data plane's public key but holds its own client key pair
    with open(os.path.join(curve_split.keys, "server.key")) as f, open(os.path.join(other, "server.key"), "w") as g:
        g.write(f.read())

    async def attempt(keys):
        client = DataPlaneClient(curve_split.dp_address, keys)
        try:
            await client.handshake(2.0)
            return await client.step(P.StepPlan(10**6), 2.0)
        finally:
            client.close()
    for keys in (other, None):
        with pytest.raises(DataPlaneDead):
            asyncio.run(attempt(keys))
    assert "refused a CURVE client" in curve_split.dp_log()
    # the real control plane is undisturbed
    status, data, _ = post_one(curve_split.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200 and data["usage"]["completion_tokens"] == 3
