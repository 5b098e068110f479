"""Every covered architecture, served by the runner in-process, equals transformers' `generate`
(eager attention, float32) token for token, with log-probs within 1e-4; every refused one is refused
at start with its name and reason (tests/architectures.py builds the tiny random models).

One run per architecture drives the real scheduler and block manager on a pool too small for the
work, so that within that run: a 70-token prompt is prefilled in chunks; its context and others pass
the sliding windows (12 and 16) and attention chunks (8); prompts share a prefix (prefix-cache hits,
except for models with state layers, which have no prefix cache: LFM2);
sequences are preempted (each architecture runs twice: preempted by recompute, then by swapping to the
CPU pool);
blocks freed by finished sequences serve later ones; where every layer has a window, blocks
that leave it go back to the pool while their sequence runs; and one prompt has two greedy parallel
samples (n=2): the second forks from the first after the prompt, sharing its blocks (the partly filled
last one copied on write) and, with state layers, a copy of its state; both equal `generate`.
"""
from __future__ import annotations

import pytest
import torch

from control_plane.block_manager import BlockManager
from data_plane import attention, model_support
from data_plane.model_runner import load_model
from shared.config import DataPlaneConfig
from tests.architectures import REFUSED, SUPPORTED, build
from tests.serve_driver import assert_same, hf_reference, serve

BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS = 4, 32, 16
# a model whose every layer has a window frees blocks as its sequences run: a smaller pool keeps it
# preempting (one sequence needs at most 16 / 4 + 1 blocks for its window and 16 / 4 for a chunk)
NUM_BLOCKS_FREEING = 10
# one with sliding and full layers frees its sliding groups' blocks (data_plane/kv_pool.py): a few blocks more
# than the longest sequence needs in all its groups
MARGIN_GROUPED = 4
BUDGET = 16       # tokens a step (serve's default)
SHARED = list(range(200, 229))   # 29 tokens: 7 full blocks shared by two prompts
PROMPTS = [[1] + list(range(300, 369)),                  # 70 tokens: prefilled in chunks, past every window
           [1] + SHARED + [7, 8], [1] + SHARED + [9],     # prefix-cache hits
           [1, 5, 9, 33, 7], [1] + list(range(100, 120))]
FORKED = {4: 2}    # n=2 for the 21-token prompt: its last block is partly filled when the sample forks


def test_the_workload_reuses_blocks_and_passes_the_windows():
    total = sum(len(p) + MAX_TOKENS for p in PROMPTS)
    assert total > NUM_BLOCKS * BLOCK_SIZE             # blocks must be freed and used again
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > NUM_BLOCKS_FREEING * BLOCK_SIZE
    assert max(len(p) for p in PROMPTS) > 16 + 16      # longer than a window plus a chunk


_expected: dict[str, list] = {}    # transformers' outputs per architecture, shared by its two runs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_served_like_transformers(name, mode):
    model = build(SUPPORTED[name], "eager")
    if name not in _expected:
        _expected[name] = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    expected = _expected[name]
    model.set_attn_implementation(attention.register())
    frees = model_support.check_model(model).freeable_window > 0
    reaches = model_support.pool_layout(model).reaches
    num_blocks = NUM_BLOCKS_FREEING if frees else NUM_BLOCKS
    if len(reaches) > 1:
        longest = [0] * (max(len(p) for p in PROMPTS) + MAX_TOKENS)
        num_blocks = BlockManager(1, BLOCK_SIZE, group_reaches=reaches).group_blocks([longest], BUDGET) + \
            MARGIN_GROUPED
    swap = mode == "swap"
    served = serve(model, PROMPTS, MAX_TOKENS, BLOCK_SIZE, num_blocks, budget=BUDGET, swap=swap, samples=FORKED)
    # preemptions: by recompute; swap_preemptions: by swapping. A model with state layers has no prefix cache
    # (a cached block holds no state)
    assert (served.prefix_hits > 0) == (served.state_slots == 0), served
    assert (served.swap_preemptions if swap else served.preemptions) > 0, served
    # a model whose every layer has a window frees the blocks that leave it (Mistral, Phi3, Mixtral); one
    # with sliding and full layers, those of its sliding groups (GPT-OSS, Gemma 2/3, Llama 4's chunks)
    windowed = served.sliding_window > 0 or any(served.group_reaches)
    assert (served.window_freed > 0) == windowed, served
    assert_same(served.outputs, expected)
    assert [i for i, _ in served.forks] == [4], served.forks
    assert served.cow_copies > 0, served
    assert_same([out for _, out in served.forks], [expected[4]])


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_at_start_with_the_architecture_and_the_reason(name, tmp_path):
    builder, reason = REFUSED[name]
    build(builder, "eager").save_pretrained(tmp_path)
    config = DataPlaneConfig(model=str(tmp_path), listen="inproc://x", block_size=BLOCK_SIZE,
                             kv_cache_blocks=NUM_BLOCKS)
    with pytest.raises(model_support.UnsupportedModel) as refusal:
        load_model(config, torch.device("cpu"))
    message = str(refusal.value)
    assert name in message and reason in message, message
