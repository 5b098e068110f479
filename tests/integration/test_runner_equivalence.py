"""The data plane's runner driven in-process by the real scheduler: paged output equals transformers'
(on CPU, and on CUDA where there is one)."""
import pytest
import torch

from control_plane.block_manager import BlockManager
from control_plane.plan_builder import build_plan
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence
from tests.helpers import make_runner, paged_model, tiny_llama


def run_greedy(runner, prompts, max_tokens, budget=16, max_num_seqs=8, caching=True, stats=None):
    """Plays the control plane: scheduler, plans, results, until every sequence has max_tokens outputs."""
    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs, budget)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [Sequence(f"r{i}", list(p), len(p), params, params.spec([]), arrival_time=float(i))
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    step = 0
    while sched.has_work():
        out = sched.schedule()
        step += 1
        plan = build_plan(step, out, sched.bm)
        sched.commit(out)
        result = runner.execute(plan)
        assert result.error is None
        sched.on_step_done(out)
        by_id = {s.seq_id: s for s in seqs}
        for tok in result.sampled:
            seq = by_id[tok.seq_id]
            seq.token_ids.append(tok.token_id)
            if seq.num_output_tokens >= max_tokens:
                sched.finish(seq, "length")
        sched.check_integrity()
    assert sched.bm.num_free_blocks() == runner.num_blocks
    if stats is not None:
        stats.update(prefix_hits=bm.prefix_hits, cow_copies=bm.num_cow_copies)
    return [s.output_token_ids for s in seqs], sched.num_preemptions


def hf_greedy(model, prompt, max_tokens):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference_model():
    return tiny_llama(attn="sdpa", seed=0)


PROMPTS = [[1, 5, 9, 33, 7], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311], [1, 42],
           [1] + list(range(100, 137))]


def test_paged_greedy_matches_transformers_with_chunking(reference_model):
    runner = make_runner(paged_model(seed=0), num_blocks=64, block_size=4)
    outputs, _ = run_greedy(runner, PROMPTS, max_tokens=12, budget=16)   # 37-token prompt is chunked
    expected = [hf_greedy(reference_model, p, 12) for p in PROMPTS]
    assert outputs == expected


def test_paged_greedy_matches_transformers_under_preemption(reference_model):
    # four 12-token prompts fit 12 of 16 blocks, but growing to 24 tokens each needs 24 blocks
    prompts = [[1] + list(range(10 * i + 3, 10 * i + 14)) for i in range(4)]
    runner = make_runner(paged_model(seed=0), num_blocks=16, block_size=4)
    outputs, preemptions = run_greedy(runner, prompts, max_tokens=12, budget=64)
    assert preemptions > 0
    assert outputs == [hf_greedy(reference_model, p, 12) for p in prompts]


def test_prefix_cache_hits_give_the_same_tokens(reference_model):
    shared = list(range(200, 221))                   # 21 tokens: 5 full blocks of 4
    prompts = [[1] + shared + [7, 8], [1] + shared + [9], [1] + shared + [7, 8]]
    expected = [hf_greedy(reference_model, p, 10) for p in prompts]
    for caching in (True, False):
        runner = make_runner(paged_model(seed=0), num_blocks=64, block_size=4)
        stats = {}
        outputs, _ = run_greedy(runner, prompts, max_tokens=10, budget=8, caching=caching, stats=stats)
        assert outputs == expected
        assert (stats["prefix_hits"] > 0) == caching


# --- CUDA: the same oracle with the compiled Triton kernels (block size 8 and up) ---------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [8, 16])
def test_cuda_greedy_matches_transformers_with_chunking_and_preemption(block_size):
    reference = tiny_llama(attn="sdpa", seed=0).to("cuda")
    prompts = PROMPTS + [[1] + list(range(10 * i + 3, 10 * i + 30)) for i in range(4)]
    expected = [hf_greedy(reference, p, 24) for p in prompts]
    # 160 tokens of pool (20 blocks of 8, 10 of 16) against 362 in all: preemption happens
    runner = make_runner(paged_model(seed=0), num_blocks=80 // block_size * 2, block_size=block_size, device="cuda")
    assert runner.pool.is_cuda
    outputs, preemptions = run_greedy(runner, prompts, max_tokens=24, budget=32)
    assert preemptions > 0
    assert outputs == expected
