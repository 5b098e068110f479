"""A model whose float32 weights are exactly GGUF codes expanded (Q4_1 layers and a Q8_0 output layer,
as the default model's file) is served with the kernel that reads the codes, and still equals
transformers' `generate` on the float32 model token for token, through the lean Llama forward and
through transformers' own forward; with the greedy head (ops/greedy_head.py: greedy rows asking for no
log-prob never compute the Q8_0 output layer in full) and without it; and a model of plain weights, whose
output layer the greedy head reads through Q8_0 codes found near it."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from data_plane import attention
from ops import cpu_kernels
from ops import greedy_head as greedy_head_module
from tests.architectures import SUPPORTED, build
from tests.helpers import bf16_head_route, gguf_form_model
from tests.serve_driver import assert_same, hf_reference, serve

SHARED = list(range(200, 229))   # 29 tokens: 7 full blocks shared by two prompts
PROMPTS = [[1] + list(range(300, 341)), [1] + SHARED + [7, 8], [1] + SHARED + [9], [1, 5, 9, 33, 7]]
MAX_TOKENS = 16
NUM_BLOCKS = 20                  # of 4 tokens: too few for the first three prompts at once


@pytest.mark.parametrize("greedy_head", [True, False])
@pytest.mark.parametrize("name", ["Llama", "Qwen3"])   # the lean forward, transformers' forward
def test_served_from_codes_like_transformers(name, greedy_head, monkeypatch):
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    if greedy_head and not kernel.has_q8_argmax():
        pytest.skip("neither AVX512-VNNI nor AVX2: no greedy head on this CPU")
    monkeypatch.setenv("PAGEDSERVE_GREEDY_HEAD", "1" if greedy_head else "0")
    monkeypatch.setitem(greedy_head_module.MIN_ROWS, kernel.q8_argmax_kind(), 1)   # this pool's steps have 1-3 rows
    model = gguf_form_model(build(SUPPORTED[name], "eager", seed=4))
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    model.set_attn_implementation(attention.register())
    rows, kinds, argmax_rows = [], set(), []
    real, real_argmax = kernel.coded_linear, kernel.q8_argmax

    def spy(x, codes, scales, mins, one_row=None):
        rows.append(x.shape[0])
        kinds.add("q4_1" if mins is not None else "q8_0")
        return real(x, codes, scales, mins, one_row)

    def spy_argmax(x, *rest):
        argmax_rows.append(x.shape[0])
        return real_argmax(x, *rest)
    real_layers = kernel.CodedLayers.forward

    def spy_layers(self, residual, *rest):
        # the lean forward's layers in one call (coded_layers.cpp): its products are the layers' Q4_1 codes
        rows.append(residual.shape[0])
        kinds.add("q4_1")
        return real_layers(self, residual, *rest)
    monkeypatch.setattr(kernel, "coded_linear", spy)
    monkeypatch.setattr(kernel.CodedLayers, "forward", spy_layers)
    monkeypatch.setattr(kernel, "q8_argmax", spy_argmax)
    # no log-probs asked for: the greedy head's condition (the log-probs are checked with it off, and below)
    served = serve(model, PROMPTS, MAX_TOKENS, block_size=4, num_blocks=NUM_BLOCKS, logprobs=None)
    assert served.preemptions > 0 and served.prefix_hits > 0, served
    # every step's projections went through the codes: prefill chunks and decode batches alike; the output
    # layer's through the greedy head where it is on (every row here is greedy without log-probs)
    if kernel.has_coded_simd():
        assert max(rows) > 4 and min(rows) == 1, rows
        assert kinds == ({"q4_1"} if greedy_head else {"q4_1", "q8_0"}), kinds
    else:   # no AVX-512: the layers keep the float32 routes (the codes' scalar loop is slower than MKL)
        assert rows == [], rows
    assert (sum(argmax_rows) > 0) == greedy_head and (not greedy_head or max(argmax_rows) > 1), argmax_rows
    assert [tokens for tokens, _ in served.outputs] == [tokens for tokens, _ in expected]
    if greedy_head:   # nobody asked for them: not computed
        assert all(math.isnan(v) for _, logprobs in served.outputs for v in logprobs)
    else:
        assert_same(served.outputs, expected)
    # asked for, the log-probs come from the full logits, whether the greedy head is there or not
    with_logprobs = serve(model, PROMPTS[:2], MAX_TOKENS, block_size=4, num_blocks=NUM_BLOCKS)
    assert_same(with_logprobs.outputs, expected[:2])


def test_greedy_head_takes_only_steps_of_enough_rows(monkeypatch):
    """The greedy head serves a step's greedy rows only from its kind's MIN_ROWS of them: fewer go through the
    full product. Steps of ten rows, with the threshold at eleven and then at ten."""
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    if not kernel.has_q8_argmax():
        pytest.skip("neither AVX512-VNNI nor AVX2: no greedy head on this CPU")
    monkeypatch.setenv("PAGEDSERVE_GREEDY_HEAD", "1")
    model = gguf_form_model(build(SUPPORTED["Llama"], "eager", seed=4))
    prompts = [[1, 10 + i, 20 + 3 * i, 7] for i in range(10)]
    expected = [hf_reference(model, p, 6) for p in prompts]
    model.set_attn_implementation(attention.register())
    real_argmax = kernel.q8_argmax
    for threshold in (11, 10):
        monkeypatch.setitem(greedy_head_module.MIN_ROWS, kernel.q8_argmax_kind(), threshold)
        argmax_rows = []

        def spy_argmax(x, *rest, seen=argmax_rows):
            seen.append(x.shape[0])
            return real_argmax(x, *rest)
        monkeypatch.setattr(kernel, "q8_argmax", spy_argmax)
        served = serve(copy.deepcopy(model), prompts, 6, block_size=4, num_blocks=64, max_num_seqs=10, logprobs=None)
        assert all(rows >= threshold for rows in argmax_rows) and bool(argmax_rows) == (threshold == 10), argmax_rows
        assert [tokens for tokens, _ in served.outputs] == [tokens for tokens, _ in expected]


def _on_and_off(kernel, model, monkeypatch, dtype: str, mark):
    """`model` served in `dtype` (greedy rows, no log-probs asked for) with the greedy head on, then off: the two
    results by on, and per run each q8_argmax call's rows and `mark` of its other arguments."""
    real_argmax = kernel.q8_argmax
    served, calls = {}, {}
    for on in (True, False):
        seen = calls[on] = []

        def spy_argmax(x, *rest, seen=seen):
            seen.append((x.shape[0], mark(rest)))
            return real_argmax(x, *rest)
        monkeypatch.setattr(kernel, "q8_argmax", spy_argmax)
        monkeypatch.setenv("PAGEDSERVE_GREEDY_HEAD", "1" if on else "0")
        served[on] = serve(copy.deepcopy(model), PROMPTS, MAX_TOKENS, block_size=4, num_blocks=NUM_BLOCKS,
                           logprobs=None, dtype=dtype)
    return served, calls


def test_bfloat16_greedy_head_gives_the_full_logits_tokens(monkeypatch):
    """Served in bfloat16 (its output layer the Q8_0 codes' rounding), greedy rows asking for no log-prob take
    the greedy head where the AVX512-BF16 kernel, or the kernel in torch's order (AVX2), is the products' route,
    and get the tokens of the full bfloat16 logits, which they get with the greedy head off."""
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    if not (kernel.has_q8_argmax() and bf16_head_route(kernel)):
        pytest.skip("no AVX512-BF16 products, nor torch's order, with the greedy head's first pass on this CPU")
    monkeypatch.setitem(greedy_head_module.MIN_ROWS, "avx512_bf16", 1)   # this pool's steps have 1-3 rows
    model = gguf_form_model(build(SUPPORTED["Llama"], "eager", seed=4))
    model.set_attn_implementation(attention.register())
    # (the weight it recomputes from: the bfloat16 layer's)
    served, calls = _on_and_off(kernel, model, monkeypatch, "bfloat16",
                                lambda rest: rest[6] is not None and rest[6].dtype == torch.bfloat16)
    for on in (True, False):
        assert bool(calls[on]) == on and all(bf16 for _, bf16 in calls[on]), calls
    assert served[True].preemptions > 0
    assert [tokens for tokens, _ in served[True].outputs] == [tokens for tokens, _ in served[False].outputs]
    assert all(math.isnan(v) for _, logprobs in served[True].outputs for v in logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_output_layer_greedy_head_gives_the_full_logits_tokens(dtype, monkeypatch):
    """A model of plain random weights (no codes): greedy rows asking for no log-prob take the greedy head through
    codes found near the output layer, where its route is the float32 panels or the AVX512-BF16 kernel, and get
    the tokens the full logits give with the greedy head off (in float32 also transformers')."""
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.failure()
    if not kernel.has_q8_argmax() or (dtype == "float32" and not kernel.has_coded_simd()) or \
            (dtype == "bfloat16" and not bf16_head_route(kernel)):
        pytest.skip("no float32 panels, AVX512-BF16 products or torch's order beside the greedy head's first pass "
                    "on this CPU")
    model = build(SUPPORTED["Llama"], "eager", seed=5)
    expected = [hf_reference(model, p, MAX_TOKENS) for p in PROMPTS] if dtype == "float32" else None
    model.set_attn_implementation(attention.register())
    # (no codes to recompute from; what the codes near the weight miss)
    served, calls = _on_and_off(kernel, model, monkeypatch, dtype, lambda rest: rest[1] is None and rest[-1] is not None)
    for on in (True, False):
        assert bool(calls[on]) == on and all(plain for _, plain in calls[on]), calls
    assert min(rows for rows, _ in calls[True]) == 1   # from one row (PLAIN_MIN_ROWS)
    assert served[True].preemptions > 0
    assert [tokens for tokens, _ in served[True].outputs] == [tokens for tokens, _ in served[False].outputs]
    if expected is not None:
        assert [tokens for tokens, _ in served[True].outputs] == [tokens for tokens, _ in expected]
    assert all(math.isnan(v) for _, logprobs in served[True].outputs for v in logprobs)
