"""Plays the control plane over an in-process ModelRunner (the real scheduler and block manager, no
engine, no sockets), and the oracle it is compared with: transformers' `generate`.

Used by the architecture matrix (tests/integration/test_architectures.py) and the sliding-window
block freeing test (tests/integration/test_window_freeing.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from control_plane.block_manager import BlockManager
from control_plane.plan_builder import build_plan
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence
from data_plane.model_runner import ModelRunner
from shared.config import DataPlaneConfig


def hf_reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the log-prob of each under the model's own logits, from `generate`."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@dataclass
class Served:
    outputs: list[tuple[list[int], list[float]]]   # per prompt: greedy tokens, their log-probs
    preemptions: int
    prefix_hits: int                 # prompt tokens served from the prefix cache
    window_freed: int                # blocks given back because they left the sliding window
    peak_blocks: int                 # most device blocks in use after any step
    sliding_window: int              # what the runner's handshake said


def serve(model, prompts: list[list[int]], max_tokens: int, block_size: int, num_blocks: int,
          max_num_seqs: int = 3, budget: int = 16, free_window: bool = True) -> Served:
    """Greedy decoding of every prompt (all queued at once, in order) on a pool of `num_blocks`;
    `free_window`: the block manager learns the window from the handshake, as the engine's does."""
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=block_size, kv_cache_blocks=num_blocks)
    runner = ModelRunner(model, config, torch.device("cpu"))
    window = runner.handshake().sliding_window
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True,
                      sliding_window=window if free_window else 0)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [Sequence(f"r{i}", list(p), len(p), params, params.spec([]), arrival_time=float(i))
            for i, p in enumerate(prompts)]
    by_id = {s.seq_id: s for s in seqs}
    logprobs = {s.seq_id: [] for s in seqs}
    for s in seqs:
        sched.add(s)
    step = peak = 0
    while sched.has_work():
        out = sched.schedule()
        step += 1
        assert step < 50 * len(prompts) * (max_tokens + 1), "the scheduler makes no progress"
        plan = build_plan(step, out, sched.bm)
        sched.commit(out)                 # what the engine does with a plan it sends
        result = runner.execute(plan)
        assert result.error is None
        sched.on_step_done(out)
        for tok in result.sampled:
            seq = by_id[tok.seq_id]
            seq.token_ids.append(tok.token_id)
            logprobs[tok.seq_id].append(tok.logprob)
            if seq.num_output_tokens >= max_tokens:
                sched.finish(seq, "length")
        sched.check_integrity()
        peak = max(peak, bm.pool.num_blocks - bm.num_free_blocks())
    outputs = [(s.output_token_ids, logprobs[s.seq_id][-max_tokens:]) for s in seqs]
    return Served(outputs, sched.num_preemptions, bm.prefix_hits, bm.num_window_freed, peak, window)


def assert_same(outputs, expected, atol: float = 1e-4) -> None:
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(outputs, expected)):
        assert tokens == want_tokens, f"prompt {i}: {tokens} != {want_tokens}"
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=atol, rtol=0)
