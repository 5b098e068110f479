"""Real processes: `pagedserve serve` (control plane + spawned data plane) on loopback, driven over HTTP."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from shared.config import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, args: list[str], tmp_dir: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        # no data-plane metrics port: several test servers run at once
        cmd = [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(self.port), "--log-interval", "2",
               "--data-plane-metrics-port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return default_model_path()


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
def hf_smollm(smollm_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(smollm_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok
