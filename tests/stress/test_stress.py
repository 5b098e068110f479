"""Swap/preemption stress against real processes with tiny pools, in each preemption mode.

A tiny random model keeps each run short; every request is deterministic, so each mode's outputs
must equal those of a server whose pool never preempts."""
import json
import re
import subprocess
import sys
import time

import pytest

from tests.servers import ROOT, Server

pytestmark = pytest.mark.slow
REQUESTS = 200


@pytest.fixture(scope="module")
def stress_servers(tiny_model_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("stress"))
    common = ["--model", tiny_model_dir, "--num-threads", "1", "--block-size", "8", "--max-num-batched-tokens",
              "256", "--log-interval", "1"]
    servers = {"reference": Server("reference", common + ["--kv-cache-blocks", "4096"], tmp)}
    for mode in ("swap", "recompute", "auto"):
        servers[mode] = Server(mode, common + ["--kv-cache-blocks", "40", "--swap-blocks", "400",
                                               "--preemption-mode", mode], tmp)
    try:
        yield {name: s.wait_ready() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()


def logged_preemptions(server) -> tuple[int, int]:
    """The (recompute, swap) preemption totals of the server's last progress line."""
    time.sleep(2.5)   # one more progress line after the run
    lines = re.findall(r"preemptions (\d+) recompute / (\d+) swap", server.log_all())
    assert lines, "no progress line in the server log"
    return int(lines[-1][0]), int(lines[-1][1])


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_stress_mode(stress_servers, mode):
    server, reference = stress_servers[mode], stress_servers["reference"]
    proc = subprocess.run([sys.executable, "bench/stress.py", "--url", server.url, "--reference-url", reference.url,
                           "--requests", str(REQUESTS), "--concurrency", str(REQUESTS), "--duration", "240",
                           "--seed", "7"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(mode, json.dumps(summary))
    assert summary["completed"] == REQUESTS and summary["failed"] == 0, summary["errors"]
    assert summary["mismatched"] == 0
    assert summary["blocks_leaked"] == 0 and summary["integrity"] == "ok"
    recompute, swap = summary["preemptions_recompute"], summary["preemptions_swap"]
    if mode == "swap":
        assert swap > 0 and recompute == 0 and summary["swap_bytes"] > 0
    elif mode == "recompute":
        assert recompute > 0   # (requests of several sequences still swap: they share blocks)
    else:
        assert swap > 0
    # the counters agree with what the server itself logged (a fresh server per mode)
    assert logged_preemptions(server) == (recompute, swap)
