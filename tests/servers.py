"""Real server processes for end-to-end and stress tests and for the benchmarks (bench/_common.py):
`pagedserve serve` on loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, log, what: str = "server",
                       poll: float = 0.5) -> None:
    """Polls `url` until it answers 200. Raises, with `log()` (the tail of the process's output), when
    the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(poll)
    raise RuntimeError(f"{what} not ready in {timeout:.0f}s:\n{log()}")


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The default CPU swap pool (2 GiB) is allocated in full by every data plane; with the servers a whole
# test run keeps alive at once, that overran the 24 GB of the CI machine (the OOM killer ended the
# run). Test servers get a quarter GiB unless a test asks for its own.
TEST_SWAP_SPACE_GIB = 0.25


class Server:
    """`pagedserve serve ARGS` on a free port, its output in `tmp_dir`/`name`.log; without a `tmp_dir`, in
    a temporary file that stop() deletes. `log_interval`: seconds between its progress lines (None: the
    server's default)."""

    def __init__(self, name: str, args: list[str], tmp_dir: str | None = None, env: dict | None = None,
                 log_interval: float | None = 2, startup_timeout: float = STARTUP_TIMEOUT,
                 swap_space_gib: float | None = TEST_SWAP_SPACE_GIB):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self._own_log = tmp_dir is None
        if self._own_log:
            fd, self.log_path = tempfile.mkstemp(prefix=f"pagedserve-{name}-", suffix=".log")
            self._log = os.fdopen(fd, "w")
        else:
            self.log_path = os.path.join(tmp_dir, f"{name}.log")
            self._log = open(self.log_path, "w")
        # no data-plane metrics port: several servers run at once, and a fixed port would clash
        cmd = [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(self.port),
               "--data-plane-metrics-port", "0"]
        if swap_space_gib is not None:   # before `args`, so that a test's own swap setting wins
            cmd += ["--swap-space-gib", str(swap_space_gib)]
        # the tests were written against neutral request defaults (temperature 1); those of the model's
        # generation config are tested where a test passes --generation-config itself
        cmd += ["--generation-config", "vllm"]
        cmd += args
        if log_interval is not None:
            cmd += ["--log-interval", str(log_interval)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self) -> "Server":
        wait_until_healthy(self.proc, self.url + "/health", self.startup_timeout, self.log)
        return self

    def log_all(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def log(self, chars: int = 5000) -> str:
        """The last `chars` characters of its output."""
        return self.log_all()[-chars:]

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
        if self._own_log:
            os.unlink(self.log_path)   # whoever needed its tail read it before


class SplitServer(Server):
    """`pagedserve data-plane` and `pagedserve control-plane` as two processes on a TCP link, as when
    they run on two machines; `extra_dp`/`extra_cp` add flags (e.g. --curve-keys) to each side."""

    def __init__(self, name: str, model: str, tmp_dir: str, extra_dp: list[str], extra_cp: list[str]):
        self.dp_address = f"tcp://127.0.0.1:{free_port()}"
        self.dp_log_path = os.path.join(tmp_dir, f"{name}-data-plane.log")
        self._dp_log = open(self.dp_log_path, "w")
        self.dp_proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "data-plane", "--model", model, "--listen", self.dp_address,
             "--metrics-port", "0", "--num-threads", "1", "--swap-space-gib", str(TEST_SWAP_SPACE_GIB), *extra_dp],
            cwd=ROOT, stdout=self._dp_log, stderr=subprocess.STDOUT)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout, self._own_log = STARTUP_TIMEOUT, False
        self.log_path = os.path.join(tmp_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.cli", "control-plane", "--model", model, "--port", str(self.port),
             "--data-plane", self.dp_address, "--log-interval", "2",
             "--state-dir", os.path.join(tmp_dir, f"{name}-state"), *extra_cp],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def dp_log(self) -> str:
        self._dp_log.flush()
        with open(self.dp_log_path) as f:
            return f.read()

    def stop(self) -> None:
        super().stop()    # the control plane leaves a data plane it did not spawn running: stop it here
        self.dp_proc.terminate()
        try:
            self.dp_proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.dp_proc.kill()
            self.dp_proc.wait()
        self._dp_log.close()
