"""The data plane's runner driven in-process by the real scheduler: paged output equals transformers'
(on CPU, and on CUDA where there is one)."""
import pytest
import torch

from tests.control_loop import play
from tests.helpers import make_runner, paged_model, tiny_llama


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
    played = play(runner, PROMPTS, 12, budget=16)   # 37-token prompt is chunked
    assert played.outputs == [hf_greedy(reference_model, p, 12) for p in PROMPTS]


def test_paged_greedy_matches_transformers_under_preemption(reference_model):
    # four 12-token prompts fit 12 of 16 blocks, but growing to 24 tokens each needs 24 blocks
    prompts = [[1] + list(range(10 * i + 3, 10 * i + 14)) for i in range(4)]
    runner = make_runner(paged_model(seed=0), num_blocks=16, block_size=4)
    played = play(runner, prompts, 12, budget=64)
    assert played.preemptions > 0
    assert played.outputs == [hf_greedy(reference_model, p, 12) for p in prompts]


def test_prefix_cache_hits_give_the_same_tokens(reference_model):
    shared = list(range(200, 221))                   # 21 tokens: 5 full blocks of 4
    prompts = [[1] + shared + [7, 8], [1] + shared + [9], [1] + shared + [7, 8]]
    expected = [hf_greedy(reference_model, p, 10) for p in prompts]
    for caching in (True, False):
        runner = make_runner(paged_model(seed=0), num_blocks=64, block_size=4)
        played = play(runner, prompts, 10, budget=8, caching=caching)
        assert played.outputs == expected
        assert (played.prefix_hits > 0) == caching


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
    played = play(runner, prompts, 24, budget=32)
    assert played.preemptions > 0
    assert played.outputs == expected
