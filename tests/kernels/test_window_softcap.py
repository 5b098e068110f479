"""Sliding-window attention and attention logit soft-capping on every path, against dense attention.

transformers' convention (masking_utils.sliding_window_overlay): a query at position i sees keys
i - W < j <= i, W positions with its own. Windows here are smaller than a block, not a multiple of
it, and larger than the context; soft-caps are small enough (5) to change the scores a lot.
"""
from __future__ import annotations

import pytest

import pagedserve_kernels.paged_attention as pa
from ops import attention, cpu_kernels, reference
from tests.kernels.conftest import assert_close_to, dense_attention, mixed_batch

# (window, softcap): window only, cap only, both, a window wider than every context
SETTINGS = [(5, None), (None, 5.0), (13, 5.0), (1000, None), (1, None)]
IDS = ["w5", "cap5", "w13-cap5", "w1000", "w1"]


@pytest.mark.parametrize("window,softcap", SETTINGS, ids=IDS)
def test_reference_matches_dense(window, softcap):
    batch = mixed_batch(1, 24, 120, 8, decode_only=False)
    out = reference.paged_attention(*batch.args(), None, window, softcap)
    assert_close_to(out, dense_attention(batch, window, softcap))


def test_the_window_and_the_cap_change_the_result():
    # the oracle itself must see both settings, or every test above would pass vacuously
    batch = mixed_batch(2, 8, 120, 8, decode_only=False)
    plain = dense_attention(batch)
    assert (dense_attention(batch, 5) - plain).abs().max() > 0.1
    assert (dense_attention(batch, None, 5.0) - plain).abs().max() > 0.01


@pytest.mark.parametrize("window,softcap", SETTINGS, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 16), (4, 4, 36)])  # AVX2 and scalar loops
def test_cpu_kernel_decode_matches_dense(window, softcap, heads, kv_heads, head_dim):
    assert cpu_kernels.load() is not None, f"the CPU kernel did not build: {cpu_kernels.failure()}"
    batch = mixed_batch(3, 30, 150, 8, decode_only=True, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    out = attention.paged_attention(*batch.args(), max_query_len=1, sliding_window=window, softcap=softcap)
    assert_close_to(out, dense_attention(batch, window, softcap))


@pytest.mark.parametrize("window,softcap", SETTINGS[:3], ids=IDS[:3])
def test_cpu_path_mixed_batch_matches_dense(window, softcap):
    batch = mixed_batch(4, 16, 100, 8, decode_only=False)
    out = attention.paged_attention(*batch.args(), sliding_window=window, softcap=softcap)
    assert_close_to(out, dense_attention(batch, window, softcap))


def test_bad_window_or_cap_is_an_error():
    batch = mixed_batch(5, 2, 20, 8, decode_only=True)
    with pytest.raises(ValueError, match="sliding_window"):
        attention.paged_attention(*batch.args(), sliding_window=-1)
    with pytest.raises(ValueError, match="softcap"):
        attention.paged_attention(*batch.args(), softcap=-2.0)


# --- Triton (interpreted on CPU: tests/kernels/conftest.py sets TRITON_INTERPRET) --------------------
@pytest.mark.parametrize("window,softcap", [(37, None), (None, 5.0), (21, 5.0)], ids=["w37", "cap5", "w21-cap5"])
@pytest.mark.parametrize("partition", [None, 48], ids=["one-partition", "split-k"])
def test_triton_decode_matches_dense(kt, window, softcap, partition):
    batch = mixed_batch(6, 5, 200, 16, decode_only=True, device=kt.device)
    batch.seq_lens[0] = 200   # spans partitions, most of them outside a window
    out = pa.paged_attention_triton(*batch.args(), max_query_len=1, partition_size=partition,
                                    sliding_window=window, softcap=softcap)
    assert_close_to(out, dense_attention(batch, window, softcap), atol=1e-4)


@pytest.mark.parametrize("window,softcap", [(37, None), (None, 5.0), (21, 5.0), (3, None)],
                         ids=["w37", "cap5", "w21-cap5", "w3"])
def test_triton_prefill_and_extend_match_dense(kt, window, softcap):
    # chunks over a cached prefix (extend), whole prompts and decode rows in one launch; windows
    # smaller than one query tile, and straddling the unmasked/causal boundary
    batch = mixed_batch(7, 6, 160, 16, decode_only=False, device=kt.device)
    out = pa.paged_attention_triton(*batch.args(), max_query_len=batch.max_query_len,
                                    sliding_window=window, softcap=softcap)
    assert_close_to(out, dense_attention(batch, window, softcap), atol=1e-4)
