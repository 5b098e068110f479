"""data_plane/decode_graphs.py: buckets, padding and static buffers of the decode graphs, on the CPU
(`--decode-graphs eager` runs the padded static path without capturing; the capture itself needs CUDA)."""
import pytest
import torch

from data_plane import decode_graphs, kv_pool
from data_plane.attention import StepContext
from tests.helpers import paged_model, play_steps


def test_buckets_cover_every_batch_size_with_bounded_padding():
    buckets = decode_graphs.buckets_up_to(128)
    assert buckets[0] == 1 and buckets[-1] == 128 and buckets == sorted(set(buckets))
    for rows in range(1, 129):
        size = next(b for b in buckets if b >= rows)
        assert size - rows < rows                    # fewer padding rows than real ones
    assert decode_graphs.buckets_up_to(100)[-1] == 128
    assert decode_graphs.buckets_up_to(300)[-1] == 320


@pytest.mark.parametrize("num_prompts", [3, 5])
def test_padded_static_steps_sample_what_plain_steps_sample(num_prompts):
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig
    prompts = [[5 + i, 9, 23, 7 * i + 1, 81, 6][: 3 + i] for i in range(num_prompts)]
    runners = {}
    for mode in ("off", "eager"):
        config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=4, kv_cache_blocks=96, swap_blocks=4,
                                 decode_graphs=mode)
        runners[mode] = ModelRunner(paged_model(seed=7), config, torch.device("cpu"))
    assert runners["off"].graphs is None
    plain, padded = (play_steps(runners[m], prompts, steps=9) for m in ("off", "eager"))
    assert runners["eager"].graphs.replays >= 9            # every decode step (and one-token chunks) took it
    assert [(s, t) for s, t, _, _ in padded] == [(s, t) for s, t, _, _ in plain]
    for (_, _, a, top_a), (_, _, b, top_b) in zip(padded, plain):
        assert a == pytest.approx(b, abs=1e-6)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def small_context(rows, width, pool):
    return StepContext(kv_pool=pool, slot_mapping=torch.arange(rows, dtype=torch.int64) + 8,
                       block_tables=torch.arange(rows * width, dtype=torch.int32).view(rows, width) + 1,
                       seq_lens=torch.arange(rows, dtype=torch.int32) + 5,
                       query_start_loc=torch.arange(rows + 1, dtype=torch.int32), max_query_len=1)


def test_loading_a_smaller_step_pads_every_row_past_it():
    pool = torch.zeros(1, 2, 8, 4, 1, 2)
    batch = decode_graphs.StaticBatch(4, max_blocks=6, kv_pool=pool, device=torch.device("cpu"))
    batch.load(torch.tensor([[11, 12, 13]]), torch.tensor([[4, 5, 6]]), small_context(3, 2, pool))
    assert batch.ids.tolist() == [[11, 12, 13, 0]]
    batch.load(torch.tensor([[21]]), torch.tensor([[9]]), small_context(1, 3, pool))
    c = batch.ctx
    assert batch.ids.tolist() == [[21, 0, 0, 0]] and batch.positions.tolist() == [[9, 0, 0, 0]]
    assert c.slot_mapping.tolist() == [8, -1, -1, -1]            # padding writes no K/V
    assert c.seq_lens.tolist() == [5, 1, 1, 1]
    assert c.block_tables[0].tolist() == [1, 2, 3, 0, 0, 0]
    assert c.block_tables[1:].abs().sum().item() == 0           # the earlier step's rows are gone
    assert c.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_steps_it_does_not_cover_run_eagerly():
    pool = torch.zeros(1, 2, 8, 4, 1, 2)
    calls = []
    graphs = decode_graphs.DecodeGraphs(lambda ids, pos, ctx: calls.append(ids.shape) or torch.zeros(ids.shape[1], 3),
                                        pool, max_blocks=4, buckets=[1, 2, 4], device=torch.device("cpu"),
                                        capture=False)
    ctx = small_context(3, 2, pool)
    out = graphs.run(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), ctx)
    assert out.shape == (3, 3) and calls == [(1, 4)]            # padded to the bucket of 4
    prefill = StepContext(pool, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens,
                          torch.tensor([0, 2, 3], dtype=torch.int32)[:3], max_query_len=2)
    assert graphs.run(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), prefill) is None
    five = small_context(5, 2, pool)
    assert graphs.run(torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), five) is None
    wide = small_context(2, 6, pool)                               # a table wider than the static one
    assert graphs.run(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), wide) is None
    assert len(calls) == 1


def test_the_graphs_memory_is_kept_out_of_the_cuda_kv_budget(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 16 * 2**30))
    cuda = torch.device("cuda")
    reserve = decode_graphs.reserve_bytes(256, 4096, 14336, 4096, 2)
    assert 256 * 2**20 < reserve < 2**30
    full = kv_pool.choose_num_blocks(2**20, cuda, None, None)
    kept = kv_pool.choose_num_blocks(2**20, cuda, None, None, reserve)
    assert full - kept == pytest.approx(reserve * kv_pool.CUDA_MEMORY_FRACTION / 2**20, abs=1)


def test_a_bad_mode_is_refused():
    from shared.config import ConfigError, DataPlaneConfig
    with pytest.raises(ConfigError, match="--decode-graphs"):
        DataPlaneConfig(model="tiny", listen="inproc://x", decode_graphs="sometimes").validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_prompts", [3, 12])
def test_captured_graphs_sample_what_eager_cuda_steps_sample(num_prompts):
    from data_plane.model_runner import ModelRunner
    from shared.config import DataPlaneConfig
    prompts = [[5 + i, 9, 23, 7 * i + 1, 81, 6][: 3 + i % 4] for i in range(num_prompts)]
    runners = {}
    for mode in ("off", "auto"):
        config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=16, kv_cache_blocks=16 * num_prompts,
                                 swap_blocks=4, decode_graphs=mode, max_model_len=256)
        runners[mode] = ModelRunner(paged_model(seed=7).to("cuda"), config, torch.device("cuda"))
    graphs = runners["auto"].graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.buckets)   # every bucket captured
    assert graphs.capture_seconds > 0
    plain, replayed = (play_steps(runners[m], prompts, steps=9) for m in ("off", "auto"))
    assert graphs.replays >= 9
    assert [(s, t) for s, t, _, _ in replayed] == [(s, t) for s, t, _, _ in plain]
    for (_, _, a, _), (_, _, b, _) in zip(replayed, plain):
        assert a == pytest.approx(b, abs=1e-5)
