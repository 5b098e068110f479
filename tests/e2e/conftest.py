"""Real processes: `pagedserve serve` (control plane + spawned data plane) on loopback, driven over HTTP."""
from __future__ import annotations

import pytest

from tests.servers import Server


@pytest.fixture(scope="session")
def servers(tmp_path_factory, smollm_path):
    """Two servers of the real SmolLM2 started together: a roomy KV pool, and one so small that
    concurrent requests must be preempted (12 blocks of 16 tokens)."""
    tmp = str(tmp_path_factory.mktemp("servers"))
    common = ["--model", smollm_path, "--num-threads", "1"]
    started = {
        "roomy": Server("roomy", common + ["--kv-cache-blocks", "512"], tmp),
        "tiny": Server("tiny", common + ["--kv-cache-blocks", "12", "--max-num-batched-tokens", "128"], tmp),
    }
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="session")
def roomy(servers):
    return servers["roomy"].wait_ready()


@pytest.fixture(scope="session")
def tiny_pool(servers):
    return servers["tiny"].wait_ready()


@pytest.fixture(scope="session")
def curve_split(tiny_model_dir, tmp_path_factory):
    """Data plane and control plane as separate processes on tcp://127.0.0.1, with CURVE keys (tiny
    model). Shared by the CURVE test and the fuzz test."""
    from shared import curve
    from tests.servers import SplitServer
    tmp = tmp_path_factory.mktemp("curve-split")
    keys = str(tmp / "keys")
    curve.keygen(keys)
    server = SplitServer("curve-split", tiny_model_dir, str(tmp), ["--curve-keys", keys, "--kv-cache-blocks", "128", "--max-model-len", "128"],
                         ["--curve-keys", keys])
    server.keys = keys
    try:
        yield server.wait_ready()
    finally:
        server.stop()
