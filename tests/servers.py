"""Real server processes for end-to-end and stress tests: `pagedserve serve` on loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    def log_all(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

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


class SplitServer(Server):
    """`pagedserve data-plane` and `pagedserve control-plane` as two processes on a TCP link, as when
    they run on two machines; `extra_dp`/`extra_cp` add flags (e.g. --curve-keys) to each side."""

    def __init__(self, name: str, model: str, tmp_dir: str, extra_dp: list[str], extra_cp: list[str]):
        self.dp_address = f"tcp://127.0.0.1:{free_port()}"
        self.dp_log_path = os.path.join(tmp_dir, f"{name}-data-plane.log")
        self._dp_log = open(self.dp_log_path, "w")
        self.dp_proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "data-plane", "--model", model, "--listen", self.dp_address,
             "--metrics-port", "0", "--num-threads", "1", *extra_dp],
            cwd=ROOT, stdout=self._dp_log, stderr=subprocess.STDOUT)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "control-plane", "--model", model, "--port", str(self.port),
             "--data-plane", self.dp_address, "--log-interval", "2", *extra_cp],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def dp_log(self) -> str:
        self._dp_log.flush()
        with open(self.dp_log_path) as f:
            return f.read()

    def stop(self) -> None:
        super().stop()    # the control plane tells the data plane to shut down
        try:
            self.dp_proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.dp_proc.kill()
            self.dp_proc.wait()
        self._dp_log.close()
