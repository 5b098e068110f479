"""The torch reference (the CPU path, and the oracle of the Triton tests) against plain dense attention.

The reference buckets decode rows by context length and gathers whole blocks; this checks it
against the simplest possible computation (conftest.dense_attention).
"""
from __future__ import annotations

import random

import pytest
import torch

from ops import reference
from tests.kernels.conftest import PagedBatch, dense_attention


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_dense_attention(seed):
    rng = random.Random(seed)
    # many decode rows of widely different lengths (several length buckets), plus extend rows
    seq_lens = [rng.randint(1, 200) for _ in range(40)]
    q_lens = [1 if i % 5 else min(l, rng.randint(2, 12)) for i, l in enumerate(seq_lens)]
    seq_lens[0] = q_lens[0] = 11   # a whole prompt (causal attention without a cached prefix)
    batch = PagedBatch(seq_lens, q_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=8,
                       dtype=torch.float32, device="cpu", seed=seed)
    assert len(reference._length_buckets([i for i, q in enumerate(q_lens) if q == 1], seq_lens)) > 1
    out = reference.paged_attention(*batch.args())
    torch.testing.assert_close(out, dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_length_buckets_cover_every_row_once_and_bound_padding():
    lens = [5, 500, 6, 7, 480, 8, 9, 10, 11, 12, 13, 14, 470, 15, 16, 17, 18, 19, 20]
    buckets = reference._length_buckets(list(range(len(lens))), lens)
    assert sorted(r for b in buckets for r in b) == list(range(len(lens)))
    for b in buckets:
        padded, used = max(lens[r] for r in b) * len(b), sum(lens[r] for r in b)
        # a bucket is either small (at most the minimum size) or pads within the bound
        assert len(b) <= reference._MIN_BUCKET or padded <= reference._MAX_PADDING * used
    # the three long rows do not share a bucket with the short ones
    long_bucket = next(b for b in buckets if 1 in b)
    assert set(long_bucket) == {1, 4, 12}
