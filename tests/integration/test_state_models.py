"""Models with state layers (LFM2: short convolutions on the state pool, attention on the KV pool; Mamba:
SSM layers only) under the real engine and the real runner in-process: parallel samples fork with a
copy of their parent's state and draw exactly what they draw when recomputed from scratch; the
KV-usage metrics, /debug/kv and the block manager agree on the blocks and state slots in use after
every step (token identity with transformers, chunked prefill and preemption:
tests/integration/test_architectures.py)."""
import asyncio
import dataclasses

import pytest

from control_plane.engine import Engine
from control_plane.sampling_params import SamplingParams
from data_plane import attention
from shared.config import ControlPlaneConfig
from control_plane.sampling_params import ValidationError
from tests.architectures import SUPPORTED, build
from tests.helpers import DigitTokenizer, assert_pool_clean, make_runner, run_all
from tests.runner_link import RunnerLink

# a state of one part (LFM2's convolution window) and of two (Mamba's window and SSM state)
MODELS = ["LFM2 (short convolutions on the state pool, attention)", "Mamba (SSM on the state pool)"]


@pytest.fixture(scope="module", params=MODELS)
def runner(request):
    model = build(SUPPORTED[request.param], "eager")
    model.set_attn_implementation(attention.register())
    return make_runner(model, num_blocks=24, block_size=4, swap_blocks=24)


def engine_over(runner, num_state_slots: int | None = None, budget: int = 16):
    """The engine over `runner`; `num_state_slots`: fewer slots than the data plane has (the control plane
    uses slots 0 .. n - 1 of its pool)."""
    hs = runner.handshake()
    if num_state_slots is not None:
        hs = dataclasses.replace(hs, num_state_slots=num_state_slots)
    client = RunnerLink(runner)
    cp = ControlPlaneConfig(model="tiny", max_num_batched_tokens=budget, enable_prefix_caching=True,
                            async_scheduling=False)
    return Engine(cp, client, hs, DigitTokenizer()), client


def test_forks_copy_the_state_and_equal_samples_recomputed_from_scratch(runner):
    prompt = [1] + list(range(40, 58))     # 19 tokens: prefilled in two chunks
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    with pytest.raises(ValidationError, match="state slots"):   # three sequences, two slots
        engine_over(runner, num_state_slots=2)[0].add_request("too-wide", prompt, params)
    forked, client = engine_over(runner)
    got = asyncio.run(run_all(forked, [(prompt, params)]))[0]
    copies = [c for plan in client.plans for c in plan.state_copies]
    assert len(copies) == 2 and len({dst for _, dst in copies}) == 2       # each child its own slot
    # the prompt's last block is shared and partly filled: each child writes into a copy of it (the KV pool's
    # copy-on-write; Mamba's pool has no slab, and the copy moves nothing)
    assert len([c for plan in client.plans for c in plan.copies]) == 2
    assert [s.num_computed_tokens for plan in client.plans for s in plan.new_seqs] == [0, 19, 19]
    assert_pool_clean(forked)
    # three slots, taken by the parent and a prompt of another request: no child can fork, each waits and
    # recomputes its prompt and first token from scratch
    alone, client = engine_over(runner, num_state_slots=3)
    others = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    again = asyncio.run(run_all(alone, [(prompt, params), ([1, 2, 3], others), ([1, 4, 5], others)]))[0]
    assert not any(plan.state_copies for plan in client.plans)
    assert [s.num_computed_tokens for plan in client.plans for s in plan.new_seqs] == [0] * 5
    assert sorted(got) == [0, 1, 2] and len({tuple(t) for t in got.values()}) > 1
    assert again == got
    assert_pool_clean(alone)


def test_kv_metrics_count_the_blocks_and_state_slots_in_use(runner):
    engine, _ = engine_over(runner, num_state_slots=3)
    bm = engine.scheduler.bm

    def metric(name):
        return engine.stats.registry.get_sample_value(name, {"model_name": "tiny"})

    async def run():
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"r{i}", [1, 3 + i, 9, 27, 11 + i, 5], params) for i in range(5)]
        seen = set()
        while any(not r.finished for r in reqs):
            await engine.step()
            engine.refresh_gauges()
            held = set(bm.tables)
            blocks = {b.block_id for table in bm.tables.values() for b in table if b is not None}
            report, load = engine.kv_report(), engine.load()
            assert report["integrity"] == "ok"
            assert report["state_slots"] == load.state_slots == metric("pagedserve_state_slots") == 3
            assert report["state_slots_used"] == load.state_slots_used == metric("pagedserve_state_slots_used") \
                == len(held) == len(bm.state_slots.held)
            assert report["device_blocks_used"] == len(blocks)
            assert metric("pagedserve_kv_cache_usage_perc") == pytest.approx(len(blocks) / bm.pool.num_blocks)
            assert len(held) <= 3 and len(engine.scheduler.running) <= 3    # admission waits for a slot
            seen.add(len(held))
        return seen
    seen = asyncio.run(run())
    assert 3 in seen and engine.kv_report()["state_slots_used"] == 0
    assert_pool_clean(engine)


def test_state_layers_are_not_split_across_ranks(runner):
    from data_plane.model_runner import ModelRunner
    from shared.config import ConfigError, DataPlaneConfig
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=4, kv_cache_blocks=8, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="state layers"):
        ModelRunner(runner.model, config, runner.device)
