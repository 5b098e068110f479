"""Plays the control plane against data-plane processes over ZeroMQ, synchronously: the real
scheduler and block manager, plans built as the engine builds them, greedy decoding."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import zmq

from control_plane.block_manager import BlockManager
from control_plane.plan_builder import build_plan
from control_plane.preemption import PreemptionPolicy
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence
from shared import protocol as P

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
    """Greedy outputs of `prompts`; the scheduler uses only blocks [0, num_blocks) of the pool (a
    smaller pool than the data plane's forces preemption). Returns (outputs, preemptions, swaps).
    With `temperature` > 0 it samples unseeded; `logprobs_out` then receives, per prompt, the
    log-probability the data plane reported for each token it drew."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, num_cpu_blocks=num_cpu_blocks)
    sched = Scheduler(bm, max_num_seqs, budget, PreemptionPolicy(mode, 1))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    seqs = [Sequence(f"r{i}", list(p), len(p), params, params.spec([]), arrival_time=float(i))
            for i, p in enumerate(prompts)]
    by_id = {s.seq_id: s for s in seqs}
    logprobs = {s.seq_id: [] for s in seqs}
    for s in seqs:
        sched.add(s)
    step = first_step = int(time.monotonic_ns() % 1_000_000)
    while sched.has_work():
        out = sched.schedule()
        step += 1
        assert step - first_step < 50 * len(prompts) * (max_tokens + 1), "the scheduler makes no progress"
        plan = build_plan(step, out, sched.bm)
        sched.commit(out)
        result = runner.execute(plan)
        assert result.error is None, result.error
        sched.on_step_done(out)
        for tok in result.sampled:
            seq = by_id[tok.seq_id]
            seq.token_ids.append(tok.token_id)
            logprobs[tok.seq_id].append(tok.logprob)
            if seq.num_output_tokens >= max_tokens:
                sched.finish(seq, "length")
        sched.check_integrity()
    assert bm.num_free_blocks() == num_blocks, "blocks leaked"
    if num_cpu_blocks:
        assert bm.cpu_usage() == 0, "CPU blocks leaked"
    if logprobs_out is not None:
        logprobs_out.extend(logprobs[s.seq_id] for s in seqs)
    return [s.output_token_ids for s in seqs], sched.num_preemptions, sched.num_swap_preemptions
