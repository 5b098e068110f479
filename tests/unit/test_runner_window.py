"""The data plane's side of freeing blocks outside the sliding window: it tells the window at the
handshake (only when every layer has one), accepts freed table entries (-1) where no query of the
step reads, refuses them anywhere else, and never reads them."""
from __future__ import annotations

import pytest
import torch

from data_plane.model_runner import PlanError
from shared.protocol import FREED_BLOCK_ID as X
from shared.protocol import CachedSequence, NewSequence, SamplingSpec, StepPlan
from tests.architectures import SUPPORTED, build
from tests.helpers import make_runner, paged_model

PROMPT = [1] + list(range(40, 59))     # 20 tokens: blocks 0-4 of 4


def _runner(name):
    from data_plane import attention
    model = build(SUPPORTED[name], "eager")
    model.set_attn_implementation(attention.register())
    return make_runner(model, num_blocks=16, block_size=4)


@pytest.mark.parametrize("name,window", [("Mistral (window 12)", 12), ("Mixtral (window 16)", 16),
                                         ("Gemma2 (caps, alternating window)", 0), ("Llama", 0)])
def test_handshake_names_the_window_only_when_every_layer_has_one(name, window):
    assert _runner(name).handshake().sliding_window == window


@pytest.mark.parametrize("cpu_kernel", ["1", "0"], ids=["cpu-kernel", "torch-reference"])
def test_freed_entries_are_never_read(monkeypatch, cpu_kernel):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", cpu_kernel)
    runner = _runner("Mistral (window 12)")
    greedy = SamplingSpec(temperature=0.0, logprobs=1)
    # two copies of the prompt, blocks 0-4 and 5-9
    first = runner.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT, 20, 0, 20, [0, 1, 2, 3, 4], greedy),
                                                 NewSequence(2, PROMPT, 20, 0, 20, [5, 6, 7, 8, 9], greedy)]))
    t1 = first.sampled[0].token_id
    assert [s.token_id for s in first.sampled] == [t1, t1]
    # copy 2 comes back as a new sequence whose first two blocks left the window (its query at 20
    # reads 9 .. 20): those entries are -1. The first two blocks of both copies hold NaN now, as if
    # freed and written by anyone (block 0 is also where the runner points a -1 entry)
    runner.pool[:, :, [0, 1, 5, 6]] = float("nan")
    second = runner.execute(StepPlan(2, forget_seq_ids=[2], cached_seqs=[CachedSequence(1, 1, [10])],
                                     new_seqs=[NewSequence(3, PROMPT + [t1], 20, 20, 1, [X, X, 7, 8, 9, 11],
                                                           greedy)]))
    by_seq = {s.seq_id: s for s in second.sampled}
    assert by_seq[3].token_id == by_seq[1].token_id
    assert by_seq[3].logprob == pytest.approx(by_seq[1].logprob, abs=1e-6)
    assert torch.isfinite(torch.tensor([by_seq[1].logprob, by_seq[3].logprob])).all()


def test_a_freed_entry_inside_the_window_is_refused():
    runner = _runner("Mistral (window 12)")
    spec = SamplingSpec(temperature=0.0)
    # the query at 20 reads 9 .. 20: block 2 (positions 8-11) is still in its window
    with pytest.raises(PlanError, match="table entry 2, inside the window"):
        runner.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT + [5], 20, 20, 1, [X, X, X, 3, 4, 5], spec)]))
    runner.execute(StepPlan(2, new_seqs=[NewSequence(2, [1, 2], 2, 0, 2, [0], spec)]))
    with pytest.raises(PlanError, match="out of range"):   # only a whole table may hold one
        runner.execute(StepPlan(3, cached_seqs=[CachedSequence(2, 1, [X])]))


def test_a_model_without_a_window_refuses_freed_entries():
    runner = make_runner(paged_model(seed=0), num_blocks=8)
    with pytest.raises(PlanError, match="out of range"):
        runner.execute(StepPlan(1, new_seqs=[NewSequence(1, [1] * 30, 30, 29, 1, [X, 1, 2, 3, 4, 5, 6, 7],
                                                         SamplingSpec(temperature=0.0))]))
