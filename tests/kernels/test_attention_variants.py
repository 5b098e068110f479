"""Attention sinks (GPT-OSS), ALiBi (BLOOM, MPT, Falcon) and chunked attention (Llama 4) on every path:
the torch reference, the C++ CPU kernel (decode rows and short prompt runs) and the Triton decode and
prefill kernels (interpreted on CPU), each against plain dense attention (conftest.dense_attention).

Sinks are large enough to take much of the softmax's mass; slopes are BLOOM's for 8 heads (up to 0.5
per position, so distant keys fade); chunks are shorter than a block, a block long, and combined with a
window and a sink, as GPT-OSS's and Llama 4's layers combine them.
"""
from __future__ import annotations

import pytest
import torch

import pagedserve_kernels.paged_attention as pa
from ops import attention, cpu_kernels, reference
from tests.kernels.conftest import assert_close_to, dense_attention, mixed_batch

HEADS = 8


def _sinks(heads=HEADS):
    return torch.linspace(-1.0, 3.0, heads)


def _slopes(heads=HEADS):
    return torch.tensor([2.0 ** (-(i + 1)) for i in range(heads)])


# name -> (window, softcap, sinks?, alibi?, chunk)
SETTINGS = {
    "sinks": (None, None, True, False, None),
    "sinks-w5": (5, None, True, False, None),
    "alibi": (None, None, False, True, None),
    "alibi-cap5": (None, 5.0, False, True, None),
    "chunk7": (None, None, False, False, 7),
    "chunk16": (None, None, False, False, 16),
    "chunk16-w5-sinks": (5, None, True, False, 16),
}


def _variant(name, heads=HEADS, device="cpu"):
    window, softcap, sinks, alibi, chunk = SETTINGS[name]
    return dict(sliding_window=window, softcap=softcap, sinks=_sinks(heads).to(device) if sinks else None,
                alibi=_slopes(heads).to(device) if alibi else None, chunk=chunk)


def test_every_variant_changes_the_result():
    # the oracle itself must see each setting, or every test below would pass vacuously
    batch = mixed_batch(2, 8, 120, 8, decode_only=False, heads=HEADS)
    plain = dense_attention(batch)
    for name in SETTINGS:
        changed = (dense_attention(batch, **_variant(name)) - plain).abs().max()
        assert changed > 0.05, (name, changed)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_reference_matches_dense(name):
    batch = mixed_batch(1, 20, 100, 8, decode_only=False, heads=HEADS)
    out = reference.paged_attention(*batch.args(), None, **_variant(name))
    assert_close_to(out, dense_attention(batch, **_variant(name)))


@pytest.mark.parametrize("name", list(SETTINGS))
# the AVX-512 register path (head_dim 32), the AVX2 loops (16) and the scalar loops (36)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 32), (2, 16), (8, 36)])
def test_cpu_kernel_matches_dense(name, kv_heads, head_dim):
    assert cpu_kernels.load() is not None, f"the CPU kernel did not build: {cpu_kernels.failure()}"
    # decode rows, short prompt runs (kernel rows) and one long run (the reference) in one call
    batch = mixed_batch(3, 16, 130, 8, decode_only=False, kv_heads=kv_heads, head_dim=head_dim, heads=HEADS)
    out = attention.paged_attention(*batch.args(), **_variant(name))
    assert_close_to(out, dense_attention(batch, **_variant(name)))


def test_cpu_kernel_takes_long_runs_to_the_reference_with_the_variant():
    batch = mixed_batch(4, 3, 100, 8, decode_only=False, heads=HEADS)
    work = attention.kernel_rows(batch.query_start_loc, batch.seq_lens, batch.block_tables, max_query=4)
    assert work.rest, "no run went to the reference"
    variant = _variant("chunk16-w5-sinks")
    out = attention.paged_attention(*batch.args(), kernel_rows=work, **variant)
    assert_close_to(out, dense_attention(batch, **variant))


def test_bad_sinks_slopes_or_chunk_are_errors():
    batch = mixed_batch(5, 2, 20, 8, decode_only=True, heads=HEADS)
    with pytest.raises(ValueError, match="sinks must be float32"):
        attention.paged_attention(*batch.args(), sinks=torch.zeros(HEADS - 1))
    with pytest.raises(ValueError, match="alibi must be float32"):
        attention.paged_attention(*batch.args(), alibi=torch.zeros(HEADS, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk"):
        attention.paged_attention(*batch.args(), chunk=-4)
    kernel = cpu_kernels.load()
    with pytest.raises(RuntimeError, match="sinks and ALiBi slopes"):
        work = attention.kernel_rows(batch.query_start_loc, batch.seq_lens, batch.block_tables)
        kernel.paged_decode(torch.empty_like(batch.query), batch.query, batch.k_cache, batch.v_cache, work.tables,
                            work.lens, work.tokens, 0.25, 0, 0.0, torch.zeros(3), None, 0)


# --- Triton (interpreted on CPU: tests/kernels/conftest.py sets TRITON_INTERPRET) --------------------
TRITON_SETTINGS = ["sinks-w5", "alibi-cap5", "chunk7", "chunk16-w5-sinks"]


@pytest.mark.parametrize("name", TRITON_SETTINGS)
@pytest.mark.parametrize("partition", [None, 48], ids=["one-partition", "split-k"])
def test_triton_decode_matches_dense(kt, name, partition):
    batch = mixed_batch(6, 4, 150, 16, decode_only=True, device=kt.device, heads=HEADS)
    batch.seq_lens[0] = 150   # spans partitions, most of them outside a window or chunk
    variant = _variant(name, device=kt.device)
    out = pa.paged_attention_triton(*batch.args(), max_query_len=1, partition_size=partition, **variant)
    assert_close_to(out, dense_attention(batch, **variant), atol=1e-4)


@pytest.mark.parametrize("name", TRITON_SETTINGS)
def test_triton_prefill_and_extend_match_dense(kt, name):
    # chunks over a cached prefix (extend), whole prompts and decode rows in one launch
    batch = mixed_batch(7, 5, 120, 16, decode_only=False, device=kt.device, heads=HEADS)
    variant = _variant(name, device=kt.device)
    out = pa.paged_attention_triton(*batch.args(), max_query_len=batch.max_query_len, **variant)
    assert_close_to(out, dense_attention(batch, **variant), atol=1e-4)
