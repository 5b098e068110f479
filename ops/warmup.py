"""Compile the Triton kernels for every kind of step before the first request arrives.

Triton compiles a kernel the first time it meets a new specialization (its compile-time sizes,
which integer arguments are 1 or multiples of 16). On a GPU each compile takes a fraction of a
second to a second, and one that happens in the middle of serving stalls every running sequence.
The kernels leave runtime-varying integers unspecialized, so a step kind has one variant: this runs
each kind once on the real cache (it is left as it was: the calls read it, and the one copy puts
block 0 back onto itself) so that all of them are compiled at start:

    write_kv           a padding slot (-1): the kernel runs, stores nothing
    decode, split-K    one long sequence: partitions plus the reduction kernel
    decode, one pass   enough sequences to fill the GPU without splitting
    prefill / mixed    one sequence of two query tokens
    copy_blocks        block 0 onto itself
"""
from __future__ import annotations

import time

import torch

from ops.attention import Backend, choose, paged_attention, write_kv
from ops.cache_ops import copy_blocks

SPLIT_CONTEXT = 1024   # long enough to be split into a few partitions on any GPU


def warm_up(caches: list[torch.Tensor], num_heads: int, backend: Backend) -> float | None:
    """Compiles the kernels if `backend` runs compiled Triton kernels (Triton on a GPU); returns the
    seconds it took, or None where nothing is compiled (the CPU path, Triton's interpreter)."""
    if backend.device_type != "cuda" or not backend.triton:
        return None
    return run_each_kernel(caches, num_heads)


def run_each_kernel(caches: list[torch.Tensor], num_heads: int) -> float:
    """Runs each attention and cache kernel once over caches[0] / caches[1] (a layer's K and V, shaped
    [blocks, block_size, kv_heads, head_dim]); copy_blocks over all of `caches`. Returns seconds."""
    start = time.perf_counter()
    k_cache, v_cache = caches[0], caches[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device, dtype = k_cache.device, k_cache.dtype
    triton = choose(device, dtype, triton=True)

    def ints(values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    def query(tokens):
        return torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)

    key = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    write_kv(key, key, k_cache, v_cache, ints([-1], torch.int64), backend=triton)
    scale = head_dim ** -0.5
    # one sequence whose table repeats block 0: read-only, any content
    width = -(-SPLIT_CONTEXT // block_size)
    paged_attention(query(1), k_cache, v_cache, torch.zeros(1, width, dtype=torch.int32, device=device),
                    ints([SPLIT_CONTEXT]), ints([0, 1]), scale, 1, backend=triton)
    # as many one-token sequences as pagedserve_kernels.paged_decode needs to run without the split (on CPU, where
    # nothing is compiled, a few: the same call)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    many = -(-4 * sms // num_kv_heads)
    paged_attention(query(many), k_cache, v_cache, torch.zeros(many, 1, dtype=torch.int32, device=device),
                    ints([1] * many), torch.arange(many + 1, dtype=torch.int32, device=device), scale, 1,
                    backend=triton)
    paged_attention(query(2), k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32, device=device),
                    ints([2]), ints([0, 2]), scale, 2, backend=triton)
    copy_blocks(caches, ints([0], torch.int64), ints([0], torch.int64), backend=triton)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
