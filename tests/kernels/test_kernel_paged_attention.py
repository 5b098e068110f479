"""Triton paged attention (decode split-K, varlen prefill/extend) against ops.reference.

Combinations: block size {8,16,32} x head dim {64,80,128} x GQA ratio {1,3,8} x dtype
{float32,float16,bfloat16} are covered pairwise by an L9 orthogonal array (every pair of levels of
any two factors appears in some case) -- the full product would be 81 cases per kernel, far too slow
for the interpreter.  Batches (1-8 sequences), contexts (1-300 tokens, partial last blocks) and
query lengths are random per case with a fixed seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedserve_kernels.paged_attention as pa
from pagedserve_kernels.paged_decode import paged_decode
from pagedserve_kernels.paged_prefill import paged_prefill

BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 80, 128)
GQA = ((2, 2), (6, 2), (8, 1))  # (query heads, kv heads): ratios 1, 3, 8 (8:1 is MQA)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
L9 = ((0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0),
      (1, 2, 0, 1), (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0))
CASES = [pytest.param(i, BLOCK_SIZES[a], HEAD_DIMS[b], GQA[c], DTYPES[d],
                      id=f"bs{BLOCK_SIZES[a]}-d{HEAD_DIMS[b]}-h{GQA[c][0]}kv{GQA[c][1]}-{str(DTYPES[d])[6:]}")
         for i, (a, b, c, d) in enumerate(L9)]
MAX_CONTEXT = 300


def _check(kt, batch, out):
    ref = batch.reference()
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, **kt.tol[batch.query.dtype])
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel <= kt.norm_tol[batch.query.dtype], f"relative error norm {rel:.2e}"


@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "split-k"])
@pytest.mark.parametrize("seed,block_size,head_dim,heads,dtype", CASES)
def test_decode(kt, seed, block_size, head_dim, heads, dtype, split):
    rng = np.random.default_rng(seed)
    batch_size = int(rng.integers(1, 9))
    seq_lens, _ = kt.random_lens(rng, batch_size, MAX_CONTEXT, 1.0)
    seq_lens[0] = int(rng.integers(200, MAX_CONTEXT + 1))  # at least one context spans partitions
    batch = kt.PagedBatch(seq_lens, [1] * batch_size, *heads, head_dim, block_size, dtype, seed=seed)
    # partitions of 32/48/128 tokens: smaller than, not a multiple of, and larger than the 64-token
    # inner step, and not aligned with the 32-token blocks (48)
    partition = (32, 48, 128)[seed % 3] if split else None
    out = pa.paged_attention_triton(*batch.args(), max_query_len=1, partition_size=partition)
    _check(kt, batch, out)


@pytest.mark.parametrize("seed,block_size,head_dim,heads,dtype", CASES)
def test_mixed_decode_and_extend(kt, seed, block_size, head_dim, heads, dtype):
    """One launch: decode rows, extends over a cached prefix, and a full prefill (q_len == context)."""
    rng = np.random.default_rng(100 + seed)
    batch_size = int(rng.integers(2, 9))
    seq_lens, q_lens = kt.random_lens(rng, batch_size, MAX_CONTEXT, 0.4)
    q_lens[0] = seq_lens[0]        # a plain prefill
    seq_lens[1], q_lens[1] = int(rng.integers(2, MAX_CONTEXT + 1)), 1  # a decode row
    batch = kt.PagedBatch(seq_lens, q_lens, *heads, head_dim, block_size, dtype, seed=seed)
    out = pa.paged_attention_triton(*batch.args(), max_query_len=batch.max_query_len)
    _check(kt, batch, out)


@pytest.mark.parametrize("seq_len,q_len,block_size", [
    (1, 1, 16),      # the smallest context
    (64, 64, 16),    # context ends exactly on a block and on the 64-key step
    (300, 150, 8),   # several query tiles of one sequence, a long cached prefix
    (257, 200, 32),  # partial last block, tiles straddling the unmasked/causal boundary
])
def test_extend_single_sequence(kt, seq_len, q_len, block_size):
    batch = kt.PagedBatch([seq_len], [q_len], 4, 2, 64, block_size, torch.float32, seed=seq_len)
    _check(kt, batch, pa.paged_attention_triton(*batch.args()))


def test_prefill_kernel_handles_decode_rows(kt):
    """The prefill kernel alone on a pure decode batch (it must serve q_len 1 rows of mixed batches)."""
    batch = kt.PagedBatch([5, 130, 64, 1], [1, 1, 1, 1], 6, 2, 80, 16, torch.float16, seed=7)
    out = torch.empty_like(batch.query)
    paged_prefill(*batch.args(), out)
    _check(kt, batch, out)


@pytest.mark.parametrize("max_query_len", [None, 3])
def test_empty_query_runs(kt, max_query_len):
    """Sequences with q_len 0 (nothing scheduled this step) in a prefill batch are skipped."""
    batch = kt.PagedBatch([40, 17, 90, 33], [3, 0, 2, 0], 8, 1, 64, 16, torch.float32, seed=3)
    _check(kt, batch, pa.paged_attention_triton(*batch.args(), max_query_len=max_query_len))


def test_decode_skips_empty_query_runs(kt):
    """max_query_len 1 with q_len 0 sequences: the decode kernels write no row for them.

    The last sequence has q_len 0, so its query_start_loc points one row past the output; `out`
    is a view of a buffer whose extra row is a NaN sentinel that must survive.
    """
    batch = kt.PagedBatch([40, 17, 90, 33], [1, 0, 1, 0], 2, 2, 64, 8, torch.float32, seed=4)
    for partition in (None, 32):  # the single-partition kernel, then split-K + reduction
        buf = torch.full((batch.query.shape[0] + 1, *batch.query.shape[1:]), float("nan"),
                         device=batch.query.device)
        out = buf[:-1]
        paged_decode(*batch.args(), out, partition_size=partition)
        _check(kt, batch, out)
        assert torch.isnan(buf[-1]).all(), "a q_len 0 sequence wrote an output row"


def test_strided_query(kt):
    """Query as a view of a fused qkv projection (token stride > heads * head_dim)."""
    batch = kt.PagedBatch([70, 33], [1, 1], 4, 2, 64, 16, torch.float32, seed=5)
    fused = torch.randn(batch.query.shape[0], 4 + 2 * 2, 64, device=batch.query.device)
    fused[:, :4] = batch.query
    batch.query = fused[:, :4]
    assert not batch.query.is_contiguous()
    _check(kt, batch, pa.paged_attention_triton(*batch.args(), max_query_len=1))
    batch2 = kt.PagedBatch([70, 33], [5, 2], 4, 2, 64, 16, torch.float32, seed=5)
    fused2 = torch.zeros(7, 8, 64, device=batch2.query.device)
    fused2[:, :4] = batch2.query
    batch2.query = fused2[:, :4]
    _check(kt, batch2, pa.paged_attention_triton(*batch2.args()))


def test_dispatch(kt, monkeypatch):
    """Pure decode batches go to the decode kernel, anything else to the prefill kernel."""
    calls = []
    real_decode, real_prefill = pa.paged_decode, pa.paged_prefill
    monkeypatch.setattr(pa, "paged_decode", lambda *a, **k: (calls.append("decode"), real_decode(*a, **k)))
    monkeypatch.setattr(pa, "paged_prefill", lambda *a, **k: (calls.append("prefill"), real_prefill(*a, **k)))
    decode = kt.PagedBatch([9, 30], [1, 1], 2, 2, 64, 8, torch.float32, seed=1)
    for mql in (1, None):  # known, and inferred from query_start_loc
        _check(kt, decode, pa.paged_attention_triton(*decode.args(), max_query_len=mql))
    # as many tokens as sequences, but q_len (2, 0): not decode
    tricky = kt.PagedBatch([9, 30], [2, 0], 2, 2, 64, 8, torch.float32, seed=1)
    _check(kt, tricky, pa.paged_attention_triton(*tricky.args()))
    mixed = kt.PagedBatch([9, 30], [1, 4], 2, 2, 64, 8, torch.float32, seed=1)
    _check(kt, mixed, pa.paged_attention_triton(*mixed.args(), max_query_len=4))
    assert calls == ["decode", "decode", "prefill", "prefill"]


def test_ops_entry_point_uses_triton(kt, monkeypatch):
    """ops.attention.paged_attention reaches these kernels when the Triton backend is chosen."""
    from ops import attention
    called = []
    real = pa.paged_attention_triton
    monkeypatch.setattr(pa, "paged_attention_triton", lambda *a, **k: (called.append(1), real(*a, **k))[1])
    batch = kt.PagedBatch([50, 12], [4, 1], 6, 2, 80, 16, torch.float16, seed=2)
    triton = attention.choose(kt.device, torch.float16, triton=True)
    _check(kt, batch, attention.paged_attention(*batch.args(), max_query_len=4, backend=triton))
    assert called == [1]


# --- GPU: large shapes, compiled kernels -------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads", [(128, (32, 8)), (80, (32, 32)), (64, (16, 2))])
def test_gpu_decode_large(kt, dtype, head_dim, heads):
    rng = np.random.default_rng(0)
    seq_lens = [8192] + [int(x) for x in rng.integers(1, 8193, size=63)]  # batch 64
    batch = kt.PagedBatch(seq_lens, [1] * 64, *heads, head_dim, 16, dtype, device="cuda")
    _check(kt, batch, pa.paged_attention_triton(*batch.args(), max_query_len=1))


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_large(kt, block_size):
    rng = np.random.default_rng(1)
    seq_lens, q_lens = kt.random_lens(rng, 16, 8192, 0.5)
    seq_lens[0], q_lens[0] = 8192, 2048  # long extend over a 6k prefix
    batch = kt.PagedBatch(seq_lens, q_lens, 32, 8, 128, block_size, torch.bfloat16, device="cuda")
    _check(kt, batch, pa.paged_attention_triton(*batch.args(), max_query_len=batch.max_query_len))
