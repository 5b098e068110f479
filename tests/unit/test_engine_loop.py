"""The engine's loop on the real model runner in-process (no sockets), on a tiny random Llama:
recovery renews what depends on the data plane's handshake, and with overlap (planning step N+1
while step N runs) every output is the one the engine gives without it."""
import asyncio
import heapq
from dataclasses import replace

import pytest
import torch

from control_plane.engine import Engine
from control_plane.preemption import PreemptionPolicy
from control_plane.sampling_params import SamplingParams
from shared.config import ControlPlaneConfig
from tests.helpers import DigitTokenizer, make_runner, paged_model
from tests.runner_link import RunnerLink


def make_engine(num_blocks=64, block_size=4, budget=32, max_num_seqs=128, mode="auto", **cp):
    cp.setdefault("async_scheduling", False)   # each step settled before the next unless a test asks for overlap
    runner = make_runner(paged_model(seed=0), num_blocks=num_blocks, block_size=block_size, swap_blocks=64)
    config = ControlPlaneConfig(model="tiny", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                preemption_mode=mode, **cp)
    return Engine(config, RunnerLink(runner), runner.handshake(), DigitTokenizer())


def test_after_a_restart_the_watermark_and_block_bytes_follow_the_new_data_plane():
    engine = make_engine(num_blocks=64)
    req = engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0))
    asyncio.run(engine.step())
    old_bytes = engine.policy.block_bytes
    # the restarted data plane has a larger pool and half-size KV (bfloat16)
    engine.hs = replace(engine.hs, num_device_blocks=2000, dtype="bfloat16")
    engine._requeue_all()
    assert engine.scheduler.watermark_blocks == 20
    assert engine.policy.block_bytes == PreemptionPolicy.block_bytes_of(engine.hs) == old_bytes // 2
    assert engine.scheduler.waiting[0].seq_id == next(iter(req.seqs))


def test_after_a_restart_the_prefix_cache_counters_go_on_from_the_new_pool():
    """The new block manager counts queries and hits from zero: the metrics add its counts to those
    of the old one (a delta against the old totals undercounted, and a negative hit delta failed the
    first step whose queries passed the old total)."""
    engine = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def run(prompts):
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while any(not r.finished for r in reqs):
            await engine.step()

    def counted():
        registry = engine.stats.registry
        return tuple(registry.get_sample_value(f"pagedserve_prefix_cache_{kind}_total", {"model_name": "tiny"})
                     for kind in ("queries", "hits"))
    shared = list(range(10, 30))                      # 5 full blocks of 4 tokens
    asyncio.run(run([shared + [40 + i] for i in range(3)]))
    old = engine.scheduler.bm
    assert counted() == (old.prefix_queries, old.prefix_hits) and old.prefix_hits > 0
    engine._requeue_all()                             # the data plane came back with an empty pool
    asyncio.run(run([[100 + 7 * i + j for j in range(30)] for i in range(4)]))   # more queries, no hits
    new = engine.scheduler.bm
    assert new.prefix_queries > old.prefix_queries and new.prefix_hits == 0
    assert counted() == (old.prefix_queries + new.prefix_queries, old.prefix_hits)


# --- overlap: planning step N+1 while step N runs gives the same outputs ----------------------
async def drive(engine, jobs, abort_at=None):
    """Runs `jobs` ((prompt ids, SamplingParams)) to the end as Engine.run would (deadlines, then a
    step). `abort_at`: {job index: (number of streamed tokens, reason)}: that request is aborted
    as soon as it has streamed that many. Returns, per job, the outputs it received."""
    reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(jobs)]
    outputs = [[] for _ in jobs]
    aborted = {}
    for _ in range(5000):
        engine._expire_deadlines()
        if not (engine.scheduler.has_work() or engine._in_flight is not None):
            break
        await engine.step()
        engine.scheduler.check_integrity()
        for i, r in enumerate(reqs):
            while not r.queue.empty():
                out = r.queue.get_nowait()
                assert i not in aborted or out.finished, f"job {i} streamed a token after it was aborted"
                outputs[i].append(out)
            limit = (abort_at or {}).get(i)
            streamed = sum(len(o.token_ids) for o in outputs[i])
            if limit and not r.finished and i not in aborted and streamed >= limit[0]:
                if limit[1] == "timeout":   # its deadline passed: the next turn of the loop ends it
                    heapq.heappush(engine._deadlines, (0.0, id(r), r))
                else:
                    engine.abort(r, limit[1])
                aborted[i] = streamed
    else:
        raise AssertionError("the engine did not finish")
    assert all(r.finished for r in reqs) and not engine.owners
    bm = engine.scheduler.bm
    assert bm.num_free_blocks() == bm.pool.num_blocks, "blocks leaked"
    for i, r in enumerate(reqs):
        while not r.queue.empty():
            outputs[i].append(r.queue.get_nowait())
    for i, n in aborted.items():
        assert sum(len(o.token_ids) for o in outputs[i]) == n, f"job {i} gained tokens after its abort"
    return [[(o.index, o.text, o.token_ids, o.finished, o.finish_reason, o.error) for o in outs]
            for outs in outputs]


def both(jobs, abort_at=None, **engine_args):
    """(without overlap, with overlap) outputs of the same jobs, and the overlapped engine."""
    engine = make_engine(**engine_args)
    plain = asyncio.run(drive(engine, jobs, abort_at))
    assert engine.client.sent_ahead == 0
    engine = make_engine(async_scheduling=True, **engine_args)
    overlapped = asyncio.run(drive(engine, jobs, abort_at))
    assert engine.client.sent_ahead > 0, "no plan was sent while another one ran"
    return plain, overlapped, engine


def reason(outputs):
    """How a job's (single) choice ended: the finish reason of its last output of a choice."""
    return [o for o in outputs if o[0] >= 0][-1][4]


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def prompts(num, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length + i % 5,), generator=g).tolist() for i in range(num)]


def test_overlap_plans_ahead_and_gives_the_same_tokens_stops_and_lengths():
    ps = prompts(6, 9)
    plain = asyncio.run(drive(make_engine(), [(p, greedy(max_tokens=12)) for p in ps]))
    # stop strings and stop tokens taken from what the plain run generated, at different depths
    first = plain[0][0][2] + plain[0][1][2] + plain[0][2][2] + plain[0][3][2]
    jobs = [(ps[0], greedy(max_tokens=12, stop=[f" {first[3]}"])),
            (ps[1], greedy(max_tokens=12, stop_token_ids=[plain[1][5][2][0]])),
            (ps[2], greedy(max_tokens=12, stop_token_ids=[plain[2][0][2][0]], min_tokens=3)),
            (ps[3], greedy(max_tokens=1)),
            (ps[4], greedy(max_tokens=2)),
            (ps[5], SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=2))]
    a, b, engine = both(jobs)
    assert a == b
    assert [reason(a[i]) for i in (0, 1, 3)] == ["stop", "stop", "length"]
    # most steps were sent while the one before still ran
    assert engine.client.sent_ahead > len(engine.client.plans) // 2


def test_overlap_is_exact_with_parallel_samples_best_of_and_beams():
    ps = prompts(4, 7, seed=1)
    jobs = [(ps[0], SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=3)),
            (ps[1], SamplingParams(max_tokens=8, temperature=0.8, seed=4, n=1, best_of=3)),
            (ps[2], SamplingParams(max_tokens=6, temperature=0.0, use_beam_search=True, best_of=3, n=2)),
            (ps[3], greedy(max_tokens=9))]
    a, b, _ = both(jobs)
    assert a == b
    assert sorted({o[0] for o in a[0] if o[0] >= 0}) == [0, 1, 2]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_overlap_is_exact_under_preemption(mode):
    # 14 blocks of 4 tokens cannot hold 6 sequences of 10 + 14 tokens: they preempt each other
    jobs = [(p, greedy(max_tokens=14)) for p in prompts(6, 10, seed=2)]
    jobs.append((prompts(1, 6, seed=3)[0], SamplingParams(max_tokens=10, temperature=0.7, seed=1, n=2)))
    a, b, engine = both(jobs, num_blocks=14, mode=mode)
    assert a == b
    kind = engine.scheduler.num_preemptions if mode == "recompute" else engine.scheduler.num_swap_preemptions
    assert kind > 0, f"the pool was meant to force {mode} preemptions"


def test_an_aborted_or_timed_out_request_never_gets_the_token_computed_ahead_for_it():
    jobs = [(p, greedy(max_tokens=20)) for p in prompts(4, 8, seed=4)]
    abort_at = {0: (3, "abort"), 1: (1, "timeout"), 2: (7, "abort")}
    a, b, engine = both(jobs, abort_at=abort_at)
    assert a == b
    assert [reason(out) for out in b] == ["abort", "timeout", "abort", "length"]
    # the data plane was told to forget them, and computed a token for at least one of them ahead
    forgotten = {s for p in engine.client.plans for s in p.forget_seq_ids}
    assert len(forgotten) >= 3
