"""Plays the control plane against data-plane processes over ZeroMQ, synchronously: the real
scheduler and block manager, the engine's two scheduler calls per step, greedy decoding."""
from __future__ import annotations

import os
import subprocess
import sys

import zmq

from shared import protocol as P
from tests.control_loop import play

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RemoteRunner:
    """A data plane at `address`, seen through the ModelRunner's `execute`."""

    def __init__(self, address: str, timeout_s: float = 300.0):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout_ms = int(timeout_s * 1000)
        self.hs: P.Handshake = self.request(P.HELLO, None)

    def request(self, kind, message):
        self.sock.send(P.encode(kind, message))
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no answer to {kind} in {self.timeout_ms} ms")
        return P.decode(self.sock.recv())[1]

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        return self.request(P.STEP_PLAN, plan)

    def handshake(self) -> P.Handshake:
        return self.hs

    def shutdown(self) -> None:
        self.sock.send(P.encode(P.SHUTDOWN))
        self.sock.close(0)


def start_data_plane(model: str, address: str, *extra: str, log_path: str | None = None) -> subprocess.Popen:
    from tests.servers import TEST_SWAP_SPACE_GIB   # the rank's swap pool, unless `extra` sets one
    cmd = [sys.executable, "-m", "data_plane", "--model", model, "--listen", address, "--metrics-port", "0",
           "--num-threads", "1", "--swap-space-gib", str(TEST_SWAP_SPACE_GIB), *extra]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def play_greedy(runner, prompts, max_tokens, num_blocks, budget=32, max_num_seqs=8, mode="recompute",
                num_cpu_blocks=0, block_size=16, temperature=0.0, logprobs_out: list | None = None):
    """Greedy outputs of `prompts` through tests/control_loop.py's `play`. Returns (outputs, preemptions, swaps). With `temperature` > 0 it samples unseeded;
    `logprobs_out` then receives, per prompt, the log-probability the data plane reported for each
    token it drew."""
    played = play(runner, prompts, max_tokens, num_blocks=num_blocks, block_size=block_size, budget=budget,
                  max_num_seqs=max_num_seqs, mode=mode, num_cpu_blocks=num_cpu_blocks, temperature=temperature)
    if logprobs_out is not None:
        logprobs_out.extend(played.logprobs)
    return played.outputs, played.preemptions, played.swap_preemptions
