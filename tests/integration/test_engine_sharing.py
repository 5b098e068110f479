"""The real engine driving the real model runner in-process (no sockets), on a tiny random Llama:
parallel samples share and copy blocks, preemption keeps outputs, and every test ends with the pool
intact (beam search against transformers: tests/integration/test_beam_equivalence.py)."""
import asyncio

import pytest

from control_plane.sampling_params import SamplingParams
from tests.helpers import assert_pool_clean, make_engine, run_all


def test_parallel_samples_share_the_prompt_and_are_reproducible():
    engine, client = make_engine(num_blocks=64)
    prompt = list(range(3, 13))        # 10 tokens: 2 full blocks + a partial one
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=4, ignore_eos=True)
    first = asyncio.run(run_all(engine, [(prompt, params)]))[0]
    assert sorted(first) == [0, 1, 2, 3] and all(len(t) == 8 for t in first.values())
    assert len({tuple(t) for t in first.values()}) > 1
    # the prompt was computed once: the plan that forked sent the children with its computed tokens
    new_seqs = [s for plan in client.plans for s in plan.new_seqs]
    assert [s.num_computed_tokens for s in new_seqs] == [0, 10, 10, 10]
    assert engine.scheduler.bm.num_cow_copies == 3   # the partial third block, copied for 3 of 4 writers
    assert_pool_clean(engine)
    again = asyncio.run(run_all(engine, [(prompt, params)]))[0]
    assert again == first
    assert_pool_clean(engine)


def test_best_of_returns_the_n_most_likely():
    engine, _ = make_engine()
    prompt = [1, 40, 41]
    outs = asyncio.run(run_all(engine, [(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=6,
                                                                ignore_eos=True))]))[0]
    best = asyncio.run(run_all(engine, [(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2,
                                                                best_of=6, ignore_eos=True))]))[0]
    assert sorted(best) == [0, 1]
    assert best[0] in outs.values() and best[1] in outs.values()
    assert_pool_clean(engine)


def test_abort_while_forked_frees_everything():
    engine, _ = make_engine()

    async def run():
        beams = engine.add_request("b", [1, 7, 8, 9, 10], SamplingParams(max_tokens=30, temperature=0.0, n=1,
                                                                         best_of=3, use_beam_search=True))
        samples = engine.add_request("s", [1, 7, 8], SamplingParams(max_tokens=30, temperature=1.0, n=3,
                                                                    ignore_eos=True))
        for _ in range(4):
            await engine.step()
        assert len(engine.scheduler.running) >= 4
        engine.abort(beams)
        engine.abort(samples)
        await engine.step()          # the data plane is told to forget them
        return beams, samples
    beams, samples = asyncio.run(run())
    assert beams.finished and samples.finished
    assert_pool_clean(engine)
    assert not engine.scheduler.has_work()


def mixed_jobs(seed=0, count=24):
    """Greedy requests of random lengths, some with parallel samples and some beams."""
    import random
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randint(3, 20))]
        kind = i % 6
        if kind == 4:
            params = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.0, n=2, best_of=3,
                                    use_beam_search=True)
        elif kind == 5:
            params = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.8, seed=i, n=3, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(4, 16), temperature=0.0, ignore_eos=bool(i % 2))
        jobs.append((prompt, params))
    return jobs


def make_swap_engine(num_blocks, mode, num_cpu_blocks=256):
    return make_engine(num_blocks, block_size=4, budget=64, mode=mode, swap_blocks=num_cpu_blocks)[0]


@pytest.fixture(scope="module")
def roomy_mixed_outputs():
    engine = make_swap_engine(1024, "recompute")
    outputs = asyncio.run(run_all(engine, mixed_jobs()))
    assert engine.scheduler.num_preemptions == 0 and engine.scheduler.num_swap_preemptions == 0
    return outputs


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_modes_give_the_outputs_of_a_roomy_pool(roomy_mixed_outputs, mode):
    engine = make_swap_engine(24, mode)
    outputs = asyncio.run(run_all(engine, mixed_jobs()))
    assert outputs == roomy_mixed_outputs
    sched = engine.scheduler
    if mode == "swap":
        assert sched.num_swap_preemptions > 0 and sched.num_preemptions == 0
    elif mode == "recompute":   # single sequences recompute; groups that share blocks still swap
        assert sched.num_preemptions > 0
    else:                        # groups swap; single sequences by cost
        assert sched.num_swap_preemptions > 0
    assert_pool_clean(engine)
    assert not sched.bm.cpu_tables and sched.bm.cpu_pool.num_free == 256


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    engine = make_swap_engine(24, "swap")

    async def run():
        reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(mixed_jobs(count=12))]
        for _ in range(200):
            await engine.step()
            if engine.scheduler.swapped:
                break
        assert engine.scheduler.swapped, "the pool of 24 blocks must swap"
        group = engine.scheduler.swapped[0]
        victim = next(r for r in reqs if r.request_id == group[0].request_id)
        engine.abort(victim)
        assert all(s.seq_id not in engine.scheduler.bm.cpu_tables for s in group)
        engine.scheduler.check_integrity()
        for r in reqs:
            engine.abort(r)
        await engine.step()
    asyncio.run(run())
    assert_pool_clean(engine)
    assert engine.scheduler.bm.cpu_pool.num_free == 256


def test_swap_is_refused_without_cpu_room_and_falls_back_to_recompute():
    engine = make_swap_engine(24, "swap", num_cpu_blocks=2)
    asyncio.run(run_all(engine, mixed_jobs(count=12)))
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(engine)
