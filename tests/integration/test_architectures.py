"""Every covered architecture, served by the runner in-process, equals transformers' `generate`
(eager attention, float32) token for token, with log-probs within 1e-4; every refused one is refused
at start with its name and reason (tests/architectures.py builds the tiny random models).

One run per architecture drives the real scheduler and block manager on a pool too small for the
work, so that within that run: a 70-token prompt is prefilled in chunks; its context and others pass
the sliding windows (12 and 16); prompts share a prefix (prefix-cache hits); sequences are preempted;
and blocks freed by finished sequences serve later ones.
"""
from __future__ import annotations

import pytest
import torch

from data_plane import attention, model_support
from data_plane.model_runner import ModelRunner, load_model
from shared.config import DataPlaneConfig
from tests.architectures import REFUSED, SUPPORTED, build
from tests.control_loop import play

BLOCK_SIZE, NUM_BLOCKS, MAX_TOKENS = 4, 32, 16
SHARED = list(range(200, 229))   # 29 tokens: 7 full blocks shared by two prompts
PROMPTS = [[1] + list(range(300, 369)),                  # 70 tokens: prefilled in chunks, past every window
           [1] + SHARED + [7, 8], [1] + SHARED + [9],     # prefix-cache hits
           [1, 5, 9, 33, 7], [1] + list(range(100, 120))]


def hf_reference(model, prompt):
    """Greedy tokens and the log-prob of each under the model's own logits, from `generate`."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                         do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def serve(model):
    """Plays the control plane over the runner; returns per prompt (tokens, log-probs) and counters."""
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=BLOCK_SIZE, kv_cache_blocks=NUM_BLOCKS)
    runner = ModelRunner(model, config, torch.device("cpu"))
    played = play(runner, PROMPTS, MAX_TOKENS, budget=16, max_num_seqs=3)
    outputs = [(tokens, logprobs[-MAX_TOKENS:]) for tokens, logprobs in zip(played.outputs, played.logprobs)]
    return outputs, dict(preemptions=played.preemptions, prefix_hits=played.prefix_hits)


def test_the_workload_reuses_blocks_and_passes_the_windows():
    total = sum(len(p) + MAX_TOKENS for p in PROMPTS)
    assert total > NUM_BLOCKS * BLOCK_SIZE             # blocks must be freed and used again
    assert max(len(p) for p in PROMPTS) > 16 + 16      # longer than a window plus a chunk


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_served_like_transformers(name):
    model = build(SUPPORTED[name], "eager")
    expected = [hf_reference(model, p) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    outputs, counters = serve(model)
    assert counters["preemptions"] > 0 and counters["prefix_hits"] > 0, counters
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(outputs, expected):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


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
