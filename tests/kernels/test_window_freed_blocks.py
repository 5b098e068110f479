"""Blocks that left the sliding window are never read, on every attention path.

The control plane frees a sequence's blocks that lie wholly before the window of its next query
(control_plane/block_manager.py); another sequence may then write anything there, and the freed
table entry is a placeholder (the data plane puts block 0 there). Here every such block, and the
block its entry is redirected to, holds NaN: a path that read it, even to mask it afterwards,
would turn the output into NaN (0 * NaN is NaN). Outputs must equal dense attention over the
clean cache.
"""
from __future__ import annotations

import random

import pytest
import torch

import pagedserve_kernels.paged_attention as pa
from ops import attention, cpu_kernels, reference
from tests.kernels.conftest import PagedBatch, dense_attention

WINDOW = 11   # not a multiple of the block size: the first live block is partly outside the window


def _poisoned(seed, num_seqs, max_len, block_size, decode_only, device="cpu"):
    """(batch whose dead blocks hold NaN and whose dead entries point at a NaN block, dense expected)."""
    rng = random.Random(seed)
    seq_lens = [rng.randint(WINDOW + 2 * block_size, max_len) for _ in range(num_seqs)]
    q_lens = [1 if decode_only or i % 2 else rng.randint(2, 3 * block_size) for i in range(num_seqs)]
    batch = PagedBatch(seq_lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size,
                       dtype=torch.float32, device=device, seed=seed, spare_blocks=2)
    expected = dense_attention(batch, WINDOW)
    # of PagedBatch's two spare blocks, the one that no table entry names (the other pads the tables)
    (nan_block,) = set(range(batch.k_cache.shape[0])) - set(batch.block_tables.flatten().tolist())
    num_dead = 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        first_query = seq_len - q_len
        dead = max(0, first_query - WINDOW + 1) // block_size
        for i in range(dead):
            block = int(batch.block_tables[s, i])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            if i % 2:   # half the entries redirected, as to a placeholder or a block now someone else's
                batch.block_tables[s, i] = nan_block
        num_dead += dead
    batch.k_cache[nan_block] = float("nan")
    batch.v_cache[nan_block] = float("nan")
    assert num_dead >= num_seqs, "the batch must have dead blocks to poison"
    return batch, expected


def _check(out, expected):
    assert torch.isfinite(out).all(), "a path read a block outside the window"
    torch.testing.assert_close(out.float(), expected, atol=2e-5, rtol=1e-4)


def test_the_poison_reaches_a_path_that_reads_dead_blocks():
    # the check above must be able to fail: attention over the whole context reads the dead blocks
    batch, _ = _poisoned(0, 4, 90, 8, decode_only=True)
    out = reference.paged_attention(*batch.args(), None, None, None)
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_reference(decode_only):
    batch, expected = _poisoned(1, 12, 100, 8, decode_only)
    _check(reference.paged_attention(*batch.args(), None, WINDOW, None), expected)


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_cpu_kernel_path(decode_only):
    assert cpu_kernels.load() is not None, f"the CPU kernel did not build: {cpu_kernels.failure()}"
    batch, expected = _poisoned(2, 12, 100, 8, decode_only)
    _check(attention.paged_attention(*batch.args(), sliding_window=WINDOW), expected)


@pytest.mark.parametrize("partition", [None, 32], ids=["one-partition", "split-k"])
def test_triton_decode(kt, partition):
    batch, expected = _poisoned(3, 4, 120, 16, decode_only=True, device=kt.device)
    _check(pa.paged_attention_triton(*batch.args(), max_query_len=1, partition_size=partition,
                                     sliding_window=WINDOW).cpu(), expected.cpu())


def test_triton_prefill_and_extend(kt):
    batch, expected = _poisoned(4, 4, 120, 16, decode_only=False, device=kt.device)
    _check(pa.paged_attention_triton(*batch.args(), max_query_len=batch.max_query_len,
                                     sliding_window=WINDOW).cpu(), expected.cpu())
