"""A model whose float32 weights are exactly Q4_1 codes (as the default model's GGUF expands) is served
with the kernel that reads the codes, and still equals transformers' `generate` on the float32
model token for token, through the lean Llama forward and through transformers' own forward."""
from __future__ import annotations

import pytest

from data_plane import attention
from ops import cpu_kernels
from tests.architectures import SUPPORTED, build
from tests.helpers import q4_1_model
from tests.serve_driver import assert_same, hf_reference, serve

SHARED = list(range(200, 229))   # 29 tokens: 7 full blocks shared by two prompts
PROMPTS = [[1] + list(range(300, 341)), [1] + SHARED + [7, 8], [1] + SHARED + [9], [1, 5, 9, 33, 7]]
MAX_TOKENS = 16
NUM_BLOCKS = 20                  # of 4 tokens: too few for the first three prompts at once


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])   # the lean forward, transformers' forward
def test_served_from_codes_like_transformers(name, monkeypatch):
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    model = q4_1_model(build(SUPPORTED[name], "eager", seed=4))
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    rows = []
    real = kernel.q4_linear
    monkeypatch.setattr(kernel, "q4_linear", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    served = serve(model, PROMPTS, MAX_TOKENS, block_size=4, num_blocks=NUM_BLOCKS)
    assert served.preemptions > 0 and served.prefix_hits > 0, served
    # every step's projections went through the codes: prefill chunks and decode batches alike
    assert max(rows) > 4 and min(rows) == 1, rows
    assert_same(served.outputs, expected)
