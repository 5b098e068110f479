"""A model whose every layer has a sliding window, served on a pool too small for its requests:
they fit only because blocks that leave the window go back to the pool while their sequence runs
(control_plane/block_manager.py). Greedy outputs equal transformers' `generate` token for token,
with prefix-cache hits served from a prefix whose head was already freed, and freed blocks reused
by other sequences. Through the real engine, parallel samples, beams and swapping give the same
outputs with and without freeing, for that model and for one whose sliding and full layers alternate
(Gemma 2), where only the sliding layers' group gives its blocks back (data_plane/kv_pool.py)."""
from __future__ import annotations

import asyncio
import functools

import pytest

from control_plane.block_manager import BlockManager
from control_plane.engine import Engine
from control_plane.sampling_params import SamplingParams
from data_plane import attention
from shared.config import ControlPlaneConfig
from tests.architectures import _llama_like, build
from tests.helpers import DigitTokenizer, assert_pool_clean, make_runner, run_all
from tests.runner_link import RunnerLink
from tests.serve_driver import assert_same, hf_reference, serve

WINDOW, BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS = 8, 4, 12, 24
MISTRAL = _llama_like("Mistral", sliding_window=WINDOW, head_dim=16)
# layers sliding, full, sliding, full: two groups of two layers, reaches [0, WINDOW]
GEMMA2 = _llama_like("Gemma2", head_dim=16, sliding_window=WINDOW, num_hidden_layers=4, query_pre_attn_scalar=16)
MODELS = {"Mistral": (MISTRAL, [WINDOW]), "Gemma2": (GEMMA2, [0, WINDOW])}
SHARED = list(range(200, 229))                     # 29 tokens
PROMPTS = [[1] + SHARED + [7, 8],                  # 31 tokens, prefilled in two steps (budget 16)
           # admitted in the second step: its prefix hit (16 tokens, blocks 0-3 of the first) needs
           # only blocks 2 and 3, and the first's blocks 0 and 1 already left the window
           [1] + SHARED + [9],
           [1] + list(range(100, 160)),            # 61 + 24 tokens: 22 blocks, almost twice the pool
           [1] + list(range(300, 309)),
           [1, 5, 9, 33, 7]]


def _blocks(num_tokens):
    return -(-num_tokens // BLOCK_SIZE)


def test_the_requests_cannot_fit_without_freeing():
    assert _blocks(max(len(p) for p in PROMPTS) + MAX_TOKENS) > NUM_BLOCKS
    # with a window, a sequence holds the blocks its next query reads, the one it writes into, and
    # those of a prefill chunk (budget 16): far fewer
    assert _blocks(WINDOW) + 1 + _blocks(16) < NUM_BLOCKS


def test_served_like_transformers_with_blocks_freed_by_the_window():
    model = build(MISTRAL, "eager")
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    served = serve(model, PROMPTS, MAX_TOKENS, BLOCK_SIZE, NUM_BLOCKS, max_num_seqs=2, budget=16)
    assert served.sliding_window == WINDOW
    assert_same(served.outputs, expected)
    total_blocks = sum(_blocks(len(p) + MAX_TOKENS) for p in PROMPTS)
    assert served.window_freed >= total_blocks - len(PROMPTS) * (_blocks(WINDOW) + 1 + _blocks(16)), served
    assert served.prefix_hits >= 16, served
    assert served.peak_blocks <= NUM_BLOCKS
    assert served.preemptions == 0, served


def _engine_outputs(name, num_blocks, free_window, mode="auto", swap_blocks=None, overlap=False):
    """Parallel samples (forks, copy-on-write), a beam search and greedy requests through the real
    engine; the block manager frees blocks outside the window unless `free_window` is False.
    `overlap`: plans are sent while the previous one runs (blocks are freed a step later)."""
    builder, reaches = MODELS[name]
    model = build(builder, "eager")
    model.set_attn_implementation(attention.register())
    runner = make_runner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, swap_blocks=swap_blocks)
    config = ControlPlaneConfig(model="tiny", max_num_batched_tokens=16, preemption_mode=mode,
                                async_scheduling=overlap)
    client = RunnerLink(runner)
    engine = Engine(config, client, runner.handshake(), DigitTokenizer())
    assert engine.scheduler.bm.reaches == reaches      # learnt from the handshake
    if not free_window:   # the same groups, none with a window
        engine.scheduler.restart(BlockManager(num_blocks, BLOCK_SIZE, num_cpu_blocks=swap_blocks or 0,
                                              group_reaches=[0] * len(reaches) if len(reaches) > 1 else None))
    jobs = [(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
            (PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, n=2, best_of=3, use_beam_search=True))]
    # more sequences than the pool holds windows for: some are swapped out, placeholders and all
    jobs += [(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in (3, 4)]
    jobs += [([1] + list(range(400, 420)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))]
    outputs = asyncio.run(run_all(engine, jobs))
    if overlap:
        assert client.sent_ahead > 0, "no plan was sent while another one ran"
    assert_pool_clean(engine)
    return outputs, engine.scheduler


@functools.cache
def _expected(name):
    """The outputs on a pool large enough for everything, nothing freed."""
    outputs, plain = _engine_outputs(name, 256, free_window=False)
    assert plain.bm.num_window_freed == 0
    return outputs


# admission keeps its bound without the window: the 81 tokens of the first job need 21 blocks, and with
# two groups 21 of the full layers' and at most 2 + 4 + 1 of the sliding ones' (window and chunk of 16)
SMALL_POOL = {"Mistral": 22, "Gemma2": 30}


@pytest.mark.parametrize("name", list(MODELS))
def test_forks_beams_and_swaps_over_freed_blocks_change_no_output(name):
    expected = _expected(name)
    outputs, sched = _engine_outputs(name, SMALL_POOL[name], free_window=True, mode="swap", swap_blocks=64)
    assert outputs == expected
    bm = sched.bm
    assert bm.num_window_freed > 0 and bm.num_cow_copies > 0, (bm.num_window_freed, bm.num_cow_copies)
    assert sched.num_swap_preemptions > 0


def test_with_overlap_freed_blocks_change_no_output():
    expected = _expected("Mistral")
    outputs, sched = _engine_outputs("Mistral", 22, free_window=True, mode="swap", swap_blocks=64, overlap=True)
    assert outputs == expected
    assert sched.bm.num_window_freed > 0 and sched.num_swap_preemptions > 0


def test_a_gemma2_model_holds_fewer_blocks_when_its_sliding_group_frees_them():
    """Two layer groups (sliding, full): the same requests on the same pool, with the sliding group's blocks
    freed and with none freed, give the same tokens; freeing holds fewer blocks at the peak."""
    model = build(GEMMA2, "eager")
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    freed = serve(model, PROMPTS, MAX_TOKENS, BLOCK_SIZE, 128, max_num_seqs=5, budget=64)
    kept = serve(model, PROMPTS, MAX_TOKENS, BLOCK_SIZE, 128, max_num_seqs=5, budget=64, free_window=False)
    assert freed.group_reaches == [0, WINDOW] and freed.window_freed > 0 and kept.window_freed == 0
    assert_same(freed.outputs, expected)
    assert_same(kept.outputs, expected)
    # every sequence at once: the full group holds all its blocks either way, the sliding group a window's
    assert freed.peak_blocks < kept.peak_blocks, (freed.peak_blocks, kept.peak_blocks)
