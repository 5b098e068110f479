"""Plays the control plane over a runner, synchronously: the real scheduler and block manager, each
step the engine's two scheduler calls (schedule, then update with the result), the result's tokens
appended, until every sequence has `max_tokens` outputs. No output processing (stops, detokenizing): the tests that use it compare the
data plane's tokens with transformers' or with another data plane's.

The runner is anything with `execute(plan) -> StepResult`: the ModelRunner in-process, or a data
plane over ZeroMQ (tests/scaleout/driver.py's RemoteRunner).
"""
from __future__ import annotations

from dataclasses import dataclass

from control_plane.block_manager import BlockManager
from control_plane.preemption import PreemptionPolicy
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Finish, Fork, Scheduler
from control_plane.sequence import Sequence


@dataclass
class Played:
    outputs: list[list[int]]        # per prompt, its output tokens
    logprobs: list[list[float]]     # per prompt, the log-prob the data plane reported for each token it drew
    preemptions: int                # preemptions of every kind
    swap_preemptions: int
    prefix_hits: int
    cow_copies: int
    window_freed: int               # blocks given back because they left the sliding window
    peak_blocks: int                # most device blocks in use after any step
    # parallel samples after the first: (prompt index, output tokens, their log-probs), in fork order
    forks: list[tuple[int, list[int], list[float]]]


def play(runner, prompts: list[list[int]], max_tokens: int | list[int], *, num_blocks: int | None = None,
         block_size: int | None = None, budget: int = 16, max_num_seqs: int = 8, caching: bool = True,
         mode: str = "recompute", num_cpu_blocks: int = 0, temperature: float = 0.0,
         sliding_window: int = 0, num_state_slots: int = 0, samples: dict[int, int] | None = None,
         group_reaches: list[int] | None = None, logprobs: int | None = 0) -> Played:
    """Runs `prompts` (greedy, or unseeded sampling at `temperature` > 0) to `max_tokens` outputs each (or
    each its own, given a list).
    The scheduler uses blocks [0, num_blocks) of the pool (default: the runner's whole pool; a smaller
    number than the data plane has forces preemption) and `num_cpu_blocks` of swap space; with
    `sliding_window` (or `group_reaches`, the handshake's layer groups) the block manager frees blocks that
    leave the window. Checks the pool's integrity
    after every step and that no block leaked at the end. `samples`: prompt index -> n, parallel samples
    of that prompt (its first step draws n tokens; samples 1 .. n - 1 fork from the first, as the output
    processor's Fork decisions do, sharing its blocks and copying its state). `logprobs`: the requests'
    (0: each drawn token's log-prob, checked by most tests; None: none asked for, so greedy rows may take
    the greedy head and report NaN)."""
    num_blocks = runner.num_blocks if num_blocks is None else num_blocks
    block_size = runner.block_size if block_size is None else block_size
    if not group_reaches:   # the data plane's layer groups, if it has several: a table each, none freeing
        group_reaches = [0] * len(runner.handshake().group_reaches) or None
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=num_cpu_blocks,
                      sliding_window=sliding_window, num_state_slots=num_state_slots, group_reaches=group_reaches)
    sched = Scheduler(bm, max_num_seqs, budget, PreemptionPolicy(mode, 1))
    samples = samples or {}
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=limits[i], temperature=temperature, n=samples.get(i, 1), logprobs=logprobs)
              for i in range(len(prompts))]
    seqs = [Sequence(f"r{i}", list(p), len(p), params[i], params[i].spec([]), arrival_time=float(i))
            for i, p in enumerate(prompts)]
    by_id = {s.seq_id: s for s in seqs}
    prompt_of = {s.seq_id: i for i, s in enumerate(seqs)}   # a sample's prompt index, forks included
    children: list[Sequence] = []
    logprobs: dict[int, list[float]] = {s.seq_id: [] for s in seqs}
    for s in seqs:
        sched.add(s)
    peak = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan.step_id < 50 * len(prompts) * (max(limits) + 1), "the scheduler makes no progress"
        result = runner.execute(plan)
        assert result.error is None, result.error
        sched.update(plan, result)
        forked, ended, draws = [], [], {}
        for tok in result.sampled:
            draws.setdefault(tok.seq_id, []).append(tok)
        for seq_id, seq_draws in draws.items():
            seq = by_id[seq_id]
            streams = [seq]
            for j in range(1, len(seq_draws)):   # forked before the first sample's token is appended
                child = Sequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params,
                                 seq.params.spec([], draw=j), sample_index=j, arrival_time=seq.arrival_time)
                by_id[child.seq_id], logprobs[child.seq_id] = child, []
                prompt_of[child.seq_id] = prompt_of[seq_id]
                children.append(child)
                forked.append(Fork(seq, child))
                streams.append(child)
            for stream, tok in zip(streams, seq_draws):
                stream.token_ids.append(tok.token_id)
                logprobs[stream.seq_id].append(tok.logprob)
                if stream.num_output_tokens >= stream.params.max_tokens:
                    ended.append(Finish(stream, "length"))
        sched.apply(forked + ended)
        sched.check_integrity()
        peak = max(peak, num_blocks - bm.num_free_blocks())
    assert bm.num_free_blocks() == num_blocks, "blocks leaked"
    assert bm.cpu_usage() == 0, "CPU blocks leaked"
    return Played([s.output_token_ids for s in seqs], [logprobs[s.seq_id] for s in seqs], sched.num_preemptions,
                  sched.num_swap_preemptions, bm.prefix_hits, bm.num_cow_copies, bm.num_window_freed, peak,
                  [(prompt_of[c.seq_id], c.output_token_ids, logprobs[c.seq_id]) for c in children])
