"""Kernel tests: Triton runs in interpreter mode on CPU, compiled on CUDA.

TRITON_INTERPRET must be set before triton is first imported (@triton.jit picks interpreter or
compiler when the kernel module is imported), hence at conftest import time.
"""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances against the float32 reference computed from the same (already rounded) inputs.
# float32: tl.dot in "ieee" precision; only summation order and exp2 differ (GPU exp2 is the
#          approximate ex2 instruction) -> 1e-4, still orders of magnitude below an indexing or
#          masking bug (those are O(0.1..1) errors on unit-variance data).
# float16: the output is rounded to fp16 (half ulp = 2^-11 relative) and, on GPU, the softmax
#          probabilities are rounded to fp16 before the P@V tensor-core dot -> 4e-3.
# bfloat16: 8-bit significand, half ulp = 2^-9 relative (~0.016 absolute for outputs near 4, where
#          a query that sees few keys copies one value row) plus P rounded to bf16 on GPU -> 2e-2.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# Elementwise bounds must allow the worst element; over long contexts the outputs are averages of
# many rows and shrink to ~0.05, where atol alone is loose.  The error norm relative to the output
# norm is also bounded: rounding noise is ~2^-11 (fp16) / 2^-9 (bf16) relative per element, so
# these bounds are several times the expected noise and far below any real bug.
NORM_TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class PagedBatch:
    """A random varlen batch over a paged cache with shuffled (non-contiguous) physical blocks."""

    def __init__(self, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 device=DEVICE, seed=0, spare_blocks=3):
        device = torch.device(device)
        gen = torch.Generator(device).manual_seed(seed)  # generate on the device: GPU shapes are big
        assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
        need = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(need) + spare_blocks  # spare blocks hold garbage nobody may read
        perm = torch.randperm(num_blocks, generator=gen, device=device).cpu()
        width = max(need) + 1  # one extra column: entries past a sequence's end must not be read
        # unused table entries point at a real spare block: reading them would corrupt results
        tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)
        taken = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[taken:taken + n]
            taken += n
        self.block_tables = tables.to(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.query = torch.randn(starts[-1], num_heads, head_dim, generator=gen, device=device).to(dtype)
        self.scale = head_dim ** -0.5
        self.max_query_len = max(q_lens)

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def reference(self, sliding_window=None, softcap=None):
        from ops import reference
        return reference.paged_attention(self.query.float(), self.k_cache.float(), self.v_cache.float(),
                                         self.block_tables, self.seq_lens, self.query_start_loc, self.scale,
                                         None, sliding_window, softcap)


def dense_attention(batch: PagedBatch, sliding_window=None, softcap=None, sinks=None, alibi=None,
                    chunk=None) -> torch.Tensor:
    """The simplest possible computation: per sequence and per query token, rebuild the context
    from the block table token by token and take a softmax over it (over the last `sliding_window`
    positions up to the query's own, and only those of its own `chunk` of positions; with scores
    soft-capped as Gemma 2 does when `softcap`, plus slope * (key position - query position) per head
    when `alibi`, and a per-head sink logit in the denominator when `sinks`)."""
    q, kc, vc = batch.query.float(), batch.k_cache.float(), batch.v_cache.float()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[s].tolist()
        slots = [(table[p // block_size], p % block_size) for p in range(seq_len)]
        keys = torch.stack([kc[b, o] for b, o in slots])      # [seq_len, kv_heads, dim]
        values = torch.stack([vc[b, o] for b, o in slots])
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            first = max(0, visible - sliding_window) if sliding_window else 0
            if chunk:
                first = max(first, (visible - 1) // chunk * chunk)
            for h in range(q.shape[1]):
                scores = keys[first:visible, h // group] @ q[starts[s] + i, h] * batch.scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                if alibi is not None:
                    scores = scores + float(alibi[h]) * torch.arange(first - visible + 1, 1).float()
                weights = scores.softmax(0)
                if sinks is not None:
                    weights = torch.cat([scores, sinks[h].float().view(1)]).softmax(0)[:-1]
                out[starts[s] + i, h] = weights @ values[first:visible, h // group]
    return out


def mixed_batch(seed, num_seqs, max_len, block_size, decode_only, heads=6, kv_heads=2, head_dim=16,
                dtype=torch.float32, device="cpu") -> PagedBatch:
    """Contexts of 1..max_len; all decode rows, or every third a query run of up to 40 tokens (the first
    a whole prompt) among decode rows."""
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
    q_lens = [1 if decode_only or i % 3 else min(s, rng.randint(2, 40)) for i, s in enumerate(seq_lens)]
    if not decode_only:
        q_lens[0] = seq_lens[0]   # a whole prompt
    return PagedBatch(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, device=device, seed=seed)


def assert_close_to(out, expected, atol=2e-5):
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=1e-4)


def random_lens(rng, batch, max_context, decode_fraction):
    """Contexts in 1..max_context; a `decode_fraction` of sequences get q_len 1, others 2..context."""
    seq_lens = [int(rng.integers(1, max_context + 1)) for _ in range(batch)]
    q_lens = []
    for s in seq_lens:
        if s == 1 or rng.random() < decode_fraction:
            q_lens.append(1)
        else:
            q_lens.append(int(rng.integers(2, s + 1)))
    return seq_lens, q_lens


@pytest.fixture
def kt():
    """The helpers above, for test modules (importing a conftest by name is fragile in pytest)."""
    return SimpleNamespace(PagedBatch=PagedBatch, random_lens=random_lens, tol=TOLERANCES,
                           norm_tol=NORM_TOLERANCES, device=DEVICE)


@pytest.fixture(scope="module")
def kernel():
    """The C++ CPU kernels; a failed build fails the test (CI's machines have a compiler)."""
    from ops import cpu_kernels
    module = cpu_kernels.load()
    assert module is not None, f"the CPU kernel did not build: {cpu_kernels.failure()}"
    return module
