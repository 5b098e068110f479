"""The runner on the Triton kernels (interpreted on CPU; tests/kernels/conftest.py sets TRITON_INTERPRET)
serves models with sliding windows and soft-caps exactly as transformers' generate does: the window
and the cap through the prefill/extend kernel (chunked prompts) and the decode kernel."""
from __future__ import annotations

import pytest
import torch

from data_plane import attention
from ops import attention as attention_ops
from tests.architectures import SUPPORTED, build
from tests.integration import test_architectures as matrix

PROMPTS = [[1] + list(range(300, 340)), [1] + list(range(200, 229)) + [7], [1] + list(range(200, 229)) + [9]]


@pytest.mark.parametrize("name", ["Gemma2 (caps, alternating window)", "Mistral (window 12)"])
def test_triton_path_serves_windows_and_caps_like_transformers(name, monkeypatch, kt):
    monkeypatch.setenv("PAGEDSERVE_TRITON", "1")
    assert attention_ops.backend(kt.device, torch.float32) == "triton"
    monkeypatch.setattr(matrix, "PROMPTS", PROMPTS)
    monkeypatch.setattr(matrix, "MAX_TOKENS", 8)
    monkeypatch.setattr(matrix, "BLOCK_SIZE", 16)
    model = build(SUPPORTED[name], "eager").to(kt.device)
    expected = [matrix.hf_reference(model, p) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    outputs, counters = matrix.serve(model)
    assert counters["prefix_hits"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(outputs, expected):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
