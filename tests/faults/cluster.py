"""pagedserve on the test bed's hosts, as on separate machines, and a steady load checked against
greedy references.

Layout (tests/faults/netbed.py gives each host its own network stack and address):
  host a: the control plane, --data-parallel replicas given as two tcp:// addresses with CURVE;
          replica 0's link passes a delay proxy on host a (off until a test slows the link)
  host b: replica 0's data plane          host c: replica 1's data plane
  host d: the clients

Fault timings are short: --step-timeout is STEP_TIMEOUT seconds here (30 by default), and every
fault lasts a few times that.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import aiohttp

from shared import curve
from tests.faults.netbed import NetBed
from tests.servers import ROOT, TEST_SWAP_SPACE_GIB

STEP_TIMEOUT = 3.0
REQUEST_TIMEOUT = 60.0       # --request-timeout: nothing waits longer than this for its answer
CLIENT_TIMEOUT = 120.0       # a client that waits this long saw a request hang: a failure
DP_PORT = 5555
PROXY_PORT = 6000
API_PORT = 8000
MAX_TOKENS = 24
READY_SECONDS = 240          # a process's start, on a loaded 2-core machine


def greedy_references(model_dir: str, num_prompts: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts and transformers' greedy continuation of each (MAX_TOKENS tokens)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(12, 40))] for _ in range(num_prompts)]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append(out[0, len(p):].tolist())
    return prompts, refs


@dataclass
class Outcome:
    prompt: int                        # index into the load's prompts
    stream: bool
    status: int | None                 # HTTP status; None: no answer (connection refused or cut)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None           # what went wrong, when something did
    complete: bool = False             # a whole answer: a 200 body, or a stream up to [DONE]


class Cluster:
    def __init__(self, bed: NetBed, model: str, keys: str, log_dir: str):
        self.bed, self.model, self.keys, self.log_dir = bed, model, keys, log_dir
        self.dp: dict[str, subprocess.Popen] = {}
        self.cp: subprocess.Popen | None = None
        self.proxy: subprocess.Popen | None = None
        self.url = f"http://{bed.address['a']}:{API_PORT}"
        self.starts = 0   # control planes started so far (each gets its own log)
        self.state_dir = os.path.join(log_dir, "state")   # the control planes' owner tokens

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def read_log(self, name: str) -> str:
        with open(self.log_path(name), errors="replace") as f:
            return f.read()

    # --- processes --------------------------------------------------------------------------
    def start_data_plane(self, host: str) -> subprocess.Popen:
        address = f"tcp://{self.bed.address[host]}:{DP_PORT}"
        self.dp[host] = self.bed.spawn(host, [
            sys.executable, "-m", "control_plane.cli", "data-plane", "--model", self.model, "--listen", address,
            "--curve-keys", self.keys, "--metrics-port", "0", "--num-threads", "1", "--kv-cache-blocks", "128",
            "--max-model-len", "256", "--swap-space-gib", str(TEST_SWAP_SPACE_GIB)],
            self.log_path(f"data-plane-{host}"), cwd=ROOT)
        return self.dp[host]

    def start_proxy(self) -> None:
        """Replica 0's link, through a delay proxy on host a (off until slow_link)."""
        a, b = self.bed.address["a"], self.bed.address["b"]
        self.proxy = self.bed.spawn("a", [sys.executable, "-m", "tests.faults.delay_proxy", "--listen",
                                          f"{a}:{PROXY_PORT}", "--to", f"{b}:{DP_PORT}", "--delay", "0.1",
                                          "--jitter", "0.02", "--off"], self.log_path("proxy"), cwd=ROOT)

    def replica_addresses(self) -> list[str]:
        return [f"tcp://{self.bed.address['a']}:{PROXY_PORT}", f"tcp://{self.bed.address['c']}:{DP_PORT}"]

    def control_plane_cmd(self, port: int = API_PORT) -> list[str]:
        cmd = [sys.executable, "-m", "control_plane.cli", "control-plane", "--model", self.model, "--host",
               self.bed.address["a"], "--port", str(port), "--curve-keys", self.keys, "--step-timeout",
               str(STEP_TIMEOUT), "--request-timeout", str(REQUEST_TIMEOUT), "--log-interval", "5",
               "--generation-config", "vllm", "--state-dir", self.state_dir]
        for address in self.replica_addresses():
            cmd += ["--data-plane", address]
        return cmd

    def start_control_plane(self) -> subprocess.Popen:
        self.starts += 1
        self.cp = self.bed.spawn("a", self.control_plane_cmd(), self.log_path(f"control-plane-{self.starts}"),
                                 cwd=ROOT)
        return self.cp

    def cp_log(self) -> str:
        return self.read_log(f"control-plane-{self.starts}")

    def signal(self, host: str, sig: int) -> None:
        os.kill(self.dp[host].pid, sig)
        if sig == signal.SIGKILL:
            self.dp[host].wait()

    def slow_link(self, on: bool, loss: float = 0.05) -> None:
        """Replica 0's link: 100 ms ± 20 ms each way (the proxy) and `loss` of host b's packets."""
        os.kill(self.proxy.pid, signal.SIGUSR1 if on else signal.SIGUSR2)
        if on:
            self.bed.loss("b", loss)
        else:
            self.bed.heal("b")

    # --- reading the control plane --------------------------------------------------------------
    def get(self, path: str) -> tuple[int | None, str]:
        """(status, body) of GET path from host d; (None, why) when nothing answers."""
        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                async with session.get(self.url + path) as resp:
                    return resp.status, await resp.text()
        try:
            return self.bed.call_in("d", asyncio.run, run())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return None, repr(exc)

    def health(self) -> tuple[int | None, dict]:
        status, body = self.get("/health")
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {"raw": body}

    def wait_health(self, want: str, down: list[int] | None = None, seconds: float = READY_SECONDS) -> dict:
        """Polls /health until its status is `want` ("ok", "degraded") with replicas `down` down."""
        deadline = time.monotonic() + seconds
        seen = None
        while time.monotonic() < deadline:
            status, seen = self.health()
            if status == 200 and seen.get("status") == want and (down is None or seen.get("replicas_down") == down):
                return seen
            if self.cp is not None and self.cp.poll() is not None:
                raise AssertionError(f"the control plane exited ({self.cp.returncode}):\n{self.cp_log()[-4000:]}")
            time.sleep(0.25)
        raise AssertionError(f"/health never said {want} (down {down}); last {seen}\n{self.cp_log()[-4000:]}")

    def metric(self, name: str, **labels) -> float:
        status, text = self.get("/metrics")
        assert status == 200, text
        total = 0.0
        for line in text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                    f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_pools_empty(self, seconds: float = 60) -> dict:
        """Every replica's pools back to 0 blocks in use (device and CPU swap), integrity ok."""
        deadline = time.monotonic() + seconds
        report = None
        while time.monotonic() < deadline:
            status, body = self.get("/debug/kv")
            if status == 200:
                report = json.loads(body)
                if (report["device_blocks_used"], report["cpu_blocks_used"], report["running"], report["waiting"],
                        report["swapped"]) == (0, 0, 0, 0, 0):
                    assert report["integrity"] == "ok", report
                    return report
            time.sleep(0.25)
        raise AssertionError(f"the pools did not drain: {report}")

    def stop(self) -> None:
        for proc in [self.cp, *self.dp.values(), self.proxy]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running_cluster(model: str, tmp, start, cls=Cluster):
    """A bed of hosts a, b, c, d with CURVE keys, and a `cls` on it whose processes start(cluster)
    starts; yielded once /health says ok. Every process and the bed are gone after, also on failure."""
    keys = str(tmp / "keys")
    curve.keygen(keys)
    with NetBed(["a", "b", "c", "d"]) as bed:
        cluster = cls(bed, model, keys, str(tmp))
        try:
            start(cluster)
            cluster.wait_health("ok")
            yield cluster
        finally:
            cluster.stop()


class Load:
    """`workers` clients on host d, each sending one request after another (greedy, every other one
    streamed) until stop(); each answer is kept as an Outcome."""

    def __init__(self, cluster: Cluster, prompts: list[list[int]], workers: int = 4):
        self.cluster, self.prompts, self.workers = cluster, prompts, workers
        self._stop = threading.Event()
        self._future = None
        self._next = 0

    def __enter__(self) -> "Load":
        self._future = self.cluster.bed.start_in("d", asyncio.run, self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        return self._future.result(timeout=CLIENT_TIMEOUT + 30)

    def wait(self, seconds: float) -> None:
        """Lets the load run `seconds` more (raises if it failed meanwhile)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._future.done():
                self._future.result()
                raise AssertionError("the load ended by itself")
            time.sleep(0.1)

    async def _run(self) -> list[Outcome]:
        outcomes: list[Outcome] = []
        timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
            async def worker():
                while not self._stop.is_set():
                    index = self._next
                    self._next += 1
                    outcome = await self._one(s, index % len(self.prompts), index % 2 == 1)
                    outcomes.append(outcome)
                    if outcome.status is None and not outcome.token_ids:
                        await asyncio.sleep(0.2)   # nothing answers (a control plane restarting)
            await asyncio.gather(*(worker() for _ in range(self.workers)))
        return outcomes

    async def _one(self, session, prompt: int, stream: bool) -> Outcome:
        body = {"prompt": self.prompts[prompt], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        out = Outcome(prompt, stream, None)
        try:
            async with session.post(self.cluster.url + "/v1/completions", json=body) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.error = (await resp.text())[:300]
                    return out
                if not stream:
                    data = await resp.json()
                    out.token_ids = data["choices"][0]["token_ids"]
                    out.complete = True
                    return out
                async for line in resp.content:
                    line = line.decode().strip()
                    if not line:
                        continue
                    payload = line.removeprefix("data: ")
                    if payload == "[DONE]":
                        out.complete = True
                        break
                    choice = json.loads(payload)["choices"][0]
                    out.token_ids += choice.get("token_ids") or []
                    if choice.get("error"):
                        out.error = choice["error"]
        except asyncio.TimeoutError:
            out.error = "the client timed out: the request hung"
        except (aiohttp.ClientError, OSError) as exc:
            out.error = f"connection: {exc!r}"
        return out


@dataclass
class Tally:
    served: int          # complete answers, each identical to its greedy reference
    failed: int          # ended with a clear error (a status other than 200, a cut connection)
    wrong: list          # answers (or parts of answers) that differ from the reference


def tally(outcomes: list[Outcome], references: list[list[int]]) -> Tally:
    served = failed = 0
    wrong = []
    for o in outcomes:
        ref = references[o.prompt]
        if o.complete and o.error is None:
            if o.token_ids == ref:
                served += 1
            else:
                wrong.append(o)
        else:
            failed += 1
            # a cut stream holds part of an answer: it must be the start of the reference
            if o.token_ids != ref[:len(o.token_ids)] or (o.error and "hung" in o.error):
                wrong.append(o)
    return Tally(served, failed, wrong)
