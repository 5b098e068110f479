"""Beam search through the real engine and runner in-process (tiny random Llama) equals transformers'
generate(num_beams=...), with and without preemption."""
import asyncio

import pytest
import torch

from control_plane.sampling_params import SamplingParams
from tests.helpers import assert_pool_clean, make_engine, run_all, tiny_llama


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(attn="sdpa", seed=0)


def hf_beams(model, prompt, width, n, max_tokens, length_penalty=1.0, early_stopping=False):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=n,
                         max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
                         early_stopping=early_stopping)
    rows = []
    for row in out[:, len(prompt):].tolist():
        if 2 in row:                      # cut the padding after the end-of-sequence token
            row = row[:row.index(2) + 1]
        rows.append(row)
    return rows


BEAM_PROMPTS = [[1, 17, 90, 4], [1, 300, 301, 302, 303, 304, 305, 306], [1, 5]]


@pytest.mark.parametrize("width,length_penalty,early", [(2, 1.0, False), (4, 1.0, False), (4, 0.5, True)])
def test_beam_search_equals_transformers(reference, width, length_penalty, early):
    engine, client = make_engine(num_blocks=128)
    params = SamplingParams(max_tokens=10, temperature=0.0, n=2, best_of=width, use_beam_search=True,
                            length_penalty=length_penalty, early_stopping=early)
    results = asyncio.run(run_all(engine, [(p, params) for p in BEAM_PROMPTS]))
    for prompt, got in zip(BEAM_PROMPTS, results):
        want = hf_beams(reference, prompt, width, 2, 10, length_penalty, early)
        assert [got[0], got[1]] == want, prompt
    assert engine.scheduler.bm.num_cow_copies > 0     # beams forked and then diverged
    assert_pool_clean(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption_still_equals_transformers(reference, mode):
    # 14 blocks of 4 tokens cannot hold three requests of four beams at once
    engine, _ = make_engine(num_blocks=14, budget=64, mode=mode)
    params = SamplingParams(max_tokens=10, temperature=0.0, n=2, best_of=4, use_beam_search=True)
    results = asyncio.run(run_all(engine, [(p, params) for p in BEAM_PROMPTS]))
    sched = engine.scheduler
    assert sched.num_swap_preemptions > 0    # beam groups are swapped in every mode
    for prompt, got in zip(BEAM_PROMPTS, results):
        assert [got[0], got[1]] == hf_beams(reference, prompt, 4, 2, 10)
    assert_pool_clean(engine)
