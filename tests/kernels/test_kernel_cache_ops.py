"""Triton write_kv / copy_blocks against ops.reference (bitwise: these ops only move data)."""
from __future__ import annotations

import pytest
import torch

from pagedserve_kernels.cache_ops import copy_blocks_triton, write_kv_triton
from ops import reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _random(shape, dtype, gen, device):
    return torch.randn(shape, generator=gen, device=device).to(dtype)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("block_size,kv_heads,head_dim,dtype", [
    (8, 1, 64, torch.float32),
    (16, 2, 80, torch.float16),
    (32, 3, 128, torch.bfloat16),   # 3 heads: the head axis is padded to 4 and masked
    (16, 4, 128, torch.float32),
])
def test_write_kv(kt, block_size, kv_heads, head_dim, dtype, slot_dtype):
    gen = torch.Generator(kt.device).manual_seed(block_size + head_dim)
    num_blocks, tokens = 6, 23
    k_cache = _random((num_blocks, block_size, kv_heads, head_dim), dtype, gen, kt.device)
    v_cache = _random((num_blocks, block_size, kv_heads, head_dim), dtype, gen, kt.device)
    key = _random((tokens, kv_heads, head_dim), dtype, gen, kt.device)
    value = _random((tokens, kv_heads, head_dim), dtype, gen, kt.device)
    last_slot = num_blocks * block_size - 1
    slots = torch.randperm(last_slot, generator=gen, device=kt.device)[:tokens]  # distinct slots
    slots[[0, 5, 6, tokens - 1]] = -1  # padding tokens, incl. first and last
    slots[3] = last_slot  # the highest slot must be reachable (block/offset arithmetic)
    slots = slots.to(slot_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, want_k, want_v, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_write_kv_from_fused_qkv_and_cast(kt):
    """key/value as strided views of a fused projection, float32 stored into a float16 cache."""
    gen = torch.Generator(kt.device).manual_seed(1)
    tokens, kv_heads, head_dim = 9, 2, 64
    qkv = _random((tokens, 4 + 2 * kv_heads, head_dim), torch.float32, gen, kt.device)
    key, value = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]
    k_cache = torch.zeros(4, 16, kv_heads, head_dim, dtype=torch.float16, device=kt.device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 4, 5, -1, 16, 17, 40, 63, 0], device=kt.device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, want_k, want_v, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert k_cache.abs().sum() > 0  # something was written at all


def test_write_kv_all_padding(kt):
    k_cache = torch.ones(2, 8, 1, 64, device=kt.device)
    v_cache = torch.ones_like(k_cache)
    key = torch.zeros(3, 1, 64, device=kt.device)
    write_kv_triton(key, key, k_cache, v_cache, torch.full((3,), -1, device=kt.device))
    assert bool((k_cache == 1).all()) and bool((v_cache == 1).all())


def test_copy_blocks(kt):
    """Several layers in one call: mixed dtypes and block shapes form separate launch groups."""
    gen = torch.Generator(kt.device).manual_seed(0)
    caches = []
    for dtype in DTYPES:  # 2 layers x K/V per dtype
        caches += [_random((10, 16, 2, 80), dtype, gen, kt.device) for _ in range(4)]
    caches.append(_random((10, 8, 1, 128), torch.float16, gen, kt.device))  # other block shape
    caches.append(torch.randint(-128, 127, (10, 32, 2, 64), dtype=torch.int8, device=kt.device,
                                generator=gen))  # 1-byte elements (an fp8 cache copies the same way)
    # odd block byte counts force narrower copy words: 30 bytes -> int16, 21 bytes -> int8
    caches.append(_random((10, 3, 1, 5), torch.float16, gen, kt.device))
    caches.append(torch.randint(-128, 127, (10, 7, 1, 3), dtype=torch.int8, device=kt.device, generator=gen))
    src = torch.tensor([0, 3, 3, 7], dtype=torch.int64, device=kt.device)
    dst = torch.tensor([9, 1, 4, 2], dtype=torch.int64, device=kt.device)
    want = [c.clone() for c in caches]
    reference.copy_blocks(want, src, dst)
    copy_blocks_triton(caches, src.to(torch.int32), dst)
    for got, exp in zip(caches, want):
        assert torch.equal(got, exp)
    assert not torch.equal(caches[0][1], caches[0][0])  # the copy changed something


def test_copy_blocks_large_block_and_noncontiguous(kt):
    """A block bigger than one copy chunk (1024 elements); a non-contiguous cache falls back."""
    gen = torch.Generator(kt.device).manual_seed(2)
    big = _random((5, 16, 4, 128), torch.float16, gen, kt.device)             # 8192 elements/block
    strided = _random((5, 16, 4, 128), torch.float32, gen, kt.device)[:, :, :2]  # view, not contiguous
    src = torch.tensor([4, 0], device=kt.device)
    dst = torch.tensor([1, 3], device=kt.device)
    want = [big.clone(), strided.clone()]
    reference.copy_blocks(want, src, dst)
    copy_blocks_triton([big, strided], src, dst)
    assert torch.equal(big, want[0]) and torch.equal(strided, want[1])


def test_ops_cache_entry_points_use_triton(kt, monkeypatch):
    """ops.write_kv / ops.cache_ops.copy_blocks reach these kernels when the Triton backend is chosen."""
    import pagedserve_kernels.cache_ops as ck
    from ops import attention, cache_ops
    called = []
    real_write, real_copy = ck.write_kv_triton, ck.copy_blocks_triton
    monkeypatch.setattr(ck, "write_kv_triton", lambda *a: (called.append("write"), real_write(*a)))
    monkeypatch.setattr(ck, "copy_blocks_triton", lambda *a: (called.append("copy"), real_copy(*a)))
    triton = attention.choose(kt.device, torch.float32, triton=True)
    k_cache = torch.zeros(3, 8, 1, 64, device=kt.device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, 1, 64, device=kt.device)
    attention.write_kv(key, key, k_cache, v_cache, torch.tensor([9, -1], device=kt.device), backend=triton)
    assert torch.equal(k_cache[1, 1], key[0])
    cache_ops.copy_blocks([k_cache, v_cache], torch.tensor([1], device=kt.device),
                          torch.tensor([2], device=kt.device), backend=triton)
    assert torch.equal(v_cache[2], v_cache[1]) and torch.equal(v_cache[2, 1], key[0])
    assert called == ["write", "copy"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cache_ops_large(kt):
    gen = torch.Generator("cuda").manual_seed(0)
    k_cache = _random((4096, 16, 8, 128), torch.bfloat16, gen, "cuda")
    v_cache = _random((4096, 16, 8, 128), torch.bfloat16, gen, "cuda")
    key = _random((8192, 8, 128), torch.bfloat16, gen, "cuda")
    slots = torch.randperm(4096 * 16, device="cuda", generator=gen)[:8192]
    slots[::7] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, key, want_k, want_v, slots)
    write_kv_triton(key, key, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    src = torch.randperm(4096, device="cuda", generator=gen)[:512]
    dst = torch.randperm(4096, device="cuda", generator=gen)
    dst = dst[~torch.isin(dst, src)][:512]  # copy-on-write: destinations are fresh blocks
    caches = [k_cache, v_cache]
    want = [c.clone() for c in caches]
    reference.copy_blocks(want, src, dst)
    copy_blocks_triton(caches, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
