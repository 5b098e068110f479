"""The runner on the Triton kernels (interpreted on CPU; tests/kernels/conftest.py sets TRITON_INTERPRET)
serves models with sliding windows and soft-caps exactly as transformers' generate does: the window
and the cap through the prefill/extend kernel (chunked prompts) and the decode kernel; blocks that left
the window (Mistral's, on every layer; Gemma 2's sliding group's) are freed and reused while the kernels
run."""
from __future__ import annotations

import pytest
import torch

from data_plane import attention
from ops import attention as attention_ops
from tests.architectures import SUPPORTED, build
from tests.serve_driver import assert_same, hf_reference, serve

PROMPTS = [[1] + list(range(300, 340)), [1] + list(range(200, 229)) + [7], [1] + list(range(200, 229)) + [9]]


@pytest.mark.parametrize("name", ["Gemma2 (caps, alternating window)", "Mistral (window 12)"])
def test_triton_path_serves_windows_and_caps_like_transformers(name, monkeypatch, kt):
    monkeypatch.setenv("PAGEDSERVE_TRITON", "1")
    assert attention_ops.choose(kt.device, torch.float32).describe() == "triton"
    model = build(SUPPORTED[name], "eager").to(kt.device)
    expected = [hf_reference(model, p, 8) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    served = serve(model, PROMPTS, 8, block_size=16, num_blocks=32)
    assert served.prefix_hits > 0
    assert (served.window_freed > 0) == (served.sliding_window > 0 or any(served.group_reaches)), served
    assert_same(served.outputs, expected)
