"""Shared by the memory benchmarks: a fake runner (the data plane without a model, behind the tests' one
in-process link, tests/runner_link.py), and a loop that drives the REAL control plane
(Engine, Scheduler, BlockManager) through a synthetic trace (bench/_common.py's synthetic_trace).

Why a fake data plane: block sharing, copy-on-write, preemption and prefix hits are all decided
by the control plane; the data plane only fills the blocks. Replacing the model by a function
that returns deterministic pseudo-random tokens (and top-k log-probabilities for beams) keeps
every control-plane decision real while a 2-core CPU runs thousands of steps in seconds. It honors
structured output's masks (StepPlan.token_masks) as the real sampler does, so the control plane's
grammar matchers accept every token it returns.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from _common import FIRST_SYNTHETIC_TOKEN, TraceRequest, progress, progress_done  # also puts the project on sys.path

from control_plane.engine import Engine
from shared.config import ControlPlaneConfig
from shared.protocol import Handshake, SampledToken, StepPlan, StepResult
from tests.runner_link import RunnerLink

EOS_ID = 2


@dataclass
class _SeqState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    spec: object


class FakeTokenizer:
    """All the engine needs: an eos id and a decode that is cheap (one character per token)."""
    eos_token_id = EOS_ID

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class FakeRunner:
    """Executes plans as data_plane/model_runner.py's ModelRunner does, without tensors: keeps the
    same per-sequence bookkeeping, checks every block table covers what it computes, and samples.

    The fake "model": a parallel sample draws tokens from a generator seeded by (seed, sequence,
    position); a beam gets the top-k of a random next-token distribution that depends only on the
    context (last 8 tokens and length), with a random sharpness, so beams compete, fork and die as
    they do over a real model. A sequence whose prompt is in `answer_len` says EOS when its output
    reaches that length (the trace's output length). A sequence with a token mask in the plan draws,
    from the same generator, one of the tokens its mask allows (only EOS once its grammar has ended)."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 49152, max_model_len: int = 8192,
                 seed: int = 0):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.vocab_size, self.max_model_len, self.seed = vocab_size, max_model_len, seed
        self.seqs: dict[int, _SeqState] = {}
        self.answer_len: dict[tuple, int] = {}
        self.observer = None                    # called with each plan before it runs
        self.num_prompt_tokens_computed = 0     # prompt positions computed (recomputes included)
        self.num_steps = 0

    def handshake(self) -> Handshake:
        return Handshake("fake", self.vocab_size, 1, 1, 1, "float32", self.block_size, self.num_blocks, 0,
                         self.max_model_len, "fake", [EOS_ID])

    def execute(self, plan: StepPlan) -> StepResult:
        if self.observer is not None:
            self.observer(plan)
        self.num_steps += 1
        for seq_id in plan.forget_seq_ids:
            self.seqs.pop(seq_id, None)
        scheduled = []
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = _SeqState(list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                                              list(new.block_ids), new.sampling)
            scheduled.append((new.seq_id, new.num_new_tokens))
        for cached in plan.cached_seqs:
            state = self.seqs[cached.seq_id]
            state.block_ids.extend(cached.new_block_ids)
            state.token_ids.extend(cached.new_token_ids)
            for index, block in cached.remaps:
                state.block_ids[index] = block
            scheduled.append((cached.seq_id, cached.num_new_tokens))
        sampled, num_tokens = [], 0
        masks = dict(plan.token_masks)
        for seq_id, num_new in scheduled:
            st = self.seqs[seq_id]
            begin, end = st.num_computed_tokens, st.num_computed_tokens + num_new
            assert 0 < num_new and end <= len(st.token_ids), f"seq {seq_id}: bad chunk {begin}..{end}"
            assert -(-end // self.block_size) <= len(st.block_ids), f"seq {seq_id}: table too short"
            assert all(0 <= b < self.num_blocks for b in st.block_ids), f"seq {seq_id}: block id out of range"
            self.num_prompt_tokens_computed += max(0, min(end, st.num_prompt_tokens) - begin)
            st.num_computed_tokens = end
            num_tokens += num_new
            if end == len(st.token_ids):
                sampled.extend(self._sample(seq_id, st, masks.get(seq_id)))
        return StepResult(plan.step_id, sampled, num_tokens)

    def _sample(self, seq_id: int, st: _SeqState, mask: bytes | None = None) -> list[SampledToken]:
        spec = st.spec
        if spec.beam_width:      # the control plane picks among the candidates and sends the token
            top = self._candidates(st.token_ids, spec.logprobs)   # (the API refuses constrained beams)
            return [SampledToken(seq_id, top[0][0], top[0][1], top)]
        allowed = None if mask is None else self._allowed(seq_id, mask)
        num_output = len(st.token_ids) - st.num_prompt_tokens
        draws = spec.n if num_output == 0 else 1
        target = self.answer_len.get(tuple(st.token_ids[:st.num_prompt_tokens]))
        out = []
        for j in range(draws):
            if target is not None and num_output + 1 >= target:
                token = EOS_ID
            else:
                rng = random.Random(hash((self.seed, seq_id, len(st.token_ids), j)))
                if allowed is None:
                    token = rng.randrange(FIRST_SYNTHETIC_TOKEN, self.vocab_size)
                else:
                    token = int(allowed[rng.randrange(len(allowed))])
            out.append(SampledToken(seq_id, token, -1.0))
        st.token_ids.append(out[0].token_id)      # like the runner: the parent keeps draw 0
        return out

    def _allowed(self, seq_id: int, mask: bytes) -> np.ndarray:
        """The token ids a packed mask allows (bit j of byte k: token 8k + j, as data_plane/sampler.py)."""
        if len(mask) * 8 < self.vocab_size:
            raise ValueError(f"seq {seq_id}: a token mask of {len(mask)} bytes does not cover {self.vocab_size} tokens")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:self.vocab_size]
        allowed = np.flatnonzero(bits)
        if not len(allowed):
            raise ValueError(f"seq {seq_id}: its token mask allows no token")
        return allowed

    def _candidates(self, token_ids: list[int], k: int) -> list[tuple[int, float]]:
        rng = random.Random(hash((self.seed, len(token_ids), tuple(token_ids[-8:]))))
        sharpness = rng.uniform(0.5, 4.0)            # confident steps and flat ones
        logits = sorted((sharpness * rng.gauss(0.0, 1.0) for _ in range(max(k, 32))), reverse=True)
        norm = max(logits) + math.log(sum(math.exp(z - max(logits)) for z in logits))
        tokens = rng.sample(range(FIRST_SYNTHETIC_TOKEN, self.vocab_size), k)
        return [(t, z - norm) for t, z in zip(tokens, logits[:k])]


def make_engine(runner, max_num_seqs: int = 256, budget: int = 2048, caching: bool = True, tokenizer=None) -> Engine:
    """The real engine over `runner` (a FakeRunner or a ModelRunner), linked in-process."""
    # the control plane's work per step, each step settled before the next (no overlap)
    cp = ControlPlaneConfig(model="fake", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            enable_prefix_caching=caching, async_scheduling=False)
    return Engine(cp, RunnerLink(runner), runner.handshake(), tokenizer or FakeTokenizer())


@dataclass
class StepSample:
    """The pool as one step's plan found it (tables already grown for the tokens it computes)."""
    blocks_used: int           # physical blocks referenced by some table
    blocks_private: int        # what the same sequences would hold with private copies of everything
    live_tokens: int           # tokens whose KV is held or being written this step
    num_seqs: int
    num_requests: int


def observe_pool(engine: Engine, samples: list[StepSample]):
    """An observer for FakeRunner: appends one StepSample per plan that computes something."""
    sched, bm = engine.scheduler, engine.scheduler.bm

    def observe(plan: StepPlan) -> None:
        new_tokens = {s.seq_id: s.num_new_tokens for s in plan.new_seqs}
        new_tokens.update({s.seq_id: s.num_new_tokens for s in plan.cached_seqs})
        if not new_tokens:
            return
        covered = [s.num_computed_tokens for s in sched.running]   # the sent plan's tokens are counted
        samples.append(StepSample(bm.pool.num_blocks - bm.num_free_blocks(),
                                  sum(bm.blocks_needed(c) for c in covered), sum(covered), len(covered),
                                  len({s.request_id for s in sched.running})))
    return observe


async def drive(engine: Engine, trace: list[TraceRequest], make_params, label: str, on_step=None) -> list:
    """Feeds the trace to the engine on a step clock (idle steps skip ahead to the next arrival) and
    steps until every request finished. `make_params(trace_request)` gives its SamplingParams;
    `on_step(requests)` runs after each step. Returns the engine's Request objects in trace order."""
    pending = deque(sorted(enumerate(trace), key=lambda it: it[1].arrival_step))
    requests: list = [None] * len(trace)
    clock = 0
    while pending or engine.scheduler.has_work():
        if not engine.scheduler.has_work() and pending:
            clock = max(clock, pending[0][1].arrival_step)
        while pending and pending[0][1].arrival_step <= clock:
            i, tr = pending.popleft()
            requests[i] = engine.add_request(f"r{i}", tr.prompt_ids, make_params(tr))
            requests[i].bench_submitted = time.perf_counter()     # for time-to-first-token
        await engine.step()
        if on_step is not None:
            on_step(requests)
        clock += 1
        done = sum(r is not None and r.finished for r in requests)
        progress(f"[{label}] step {clock}, {done}/{len(trace)} requests finished")
    progress_done()
    engine.scheduler.check_integrity()
    bm = engine.scheduler.bm
    assert not bm.tables and bm.num_free_blocks() == bm.pool.num_blocks, "blocks leaked"
    failed = [r.request_id for r in requests if any(o.error for o in _drain(r))]
    assert not failed, f"requests failed: {failed[:5]}"
    return requests


def _drain(req) -> list:
    outs = []
    while not req.queue.empty():
        outs.append(req.queue.get_nowait())
    return outs
