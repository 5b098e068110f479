"""A model whose float32 weights are exactly GGUF codes expanded (Q4_1 layers and a Q8_0 output layer,
as the default model's file) is served with the kernel that reads the codes, and still equals
transformers' `generate` on the float32 model token for token, through the lean Llama forward and
through transformers' own forward."""
from __future__ import annotations

import pytest

from data_plane import attention
from ops import cpu_kernels
from tests.architectures import SUPPORTED, build
from tests.helpers import gguf_form_model
from tests.serve_driver import assert_same, hf_reference, serve

SHARED = list(range(200, 229))   # 29 tokens: 7 full blocks shared by two prompts
PROMPTS = [[1] + list(range(300, 341)), [1] + SHARED + [7, 8], [1] + SHARED + [9], [1, 5, 9, 33, 7]]
MAX_TOKENS = 16
NUM_BLOCKS = 20                  # of 4 tokens: too few for the first three prompts at once


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])   # the lean forward, transformers' forward
def test_served_from_codes_like_transformers(name, monkeypatch):
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    model = gguf_form_model(build(SUPPORTED[name], "eager", seed=4))
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    rows, kinds = [], set()
    real = kernel.coded_linear

    def spy(x, codes, scales, mins):
        rows.append(x.shape[0])
        kinds.add("q4_1" if mins is not None else "q8_0")
        return real(x, codes, scales, mins)
    monkeypatch.setattr(kernel, "coded_linear", spy)
    served = serve(model, PROMPTS, MAX_TOKENS, block_size=4, num_blocks=NUM_BLOCKS)
    assert served.preemptions > 0 and served.prefix_hits > 0, served
    # every step's projections went through the codes: prefill chunks and decode batches alike
    assert max(rows) > 4 and min(rows) == 1 and kinds == {"q4_1", "q8_0"}, (rows, kinds)
    assert_same(served.outputs, expected)
