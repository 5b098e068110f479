"""Triton cache kernels: store new K/V into their slots, and copy whole blocks (copy-on-write).

Cache layout (see ops/attention.py): ``cache[num_blocks, block_size, kv_heads, head_dim]``;
slot = block_id * block_size + offset, slot -1 = padding (skipped).

Swapping blocks between the device and the CPU pool has no Triton kernel here on purpose: a
swap is bound by the host link (PCIe/NVLink-C2C), and data_plane/swap.py's gather into pinned
staging memory, one bulk copy (``non_blocking=False``: the step waits for it) and ``index_copy_``
already move the blocks at link speed; a Triton kernel cannot read pageable host memory, and
gathering into a staging buffer first is exactly what index_select does. No gain to win, so no kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels.paged_common import next_pow2


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ct, stride_ch,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token, all of its kv heads at once: [BLOCK_H, BLOCK_D] tile.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    # int64 before multiplying by strides: block * stride_cb overflows int32 on big caches
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)  # pads head_dim 80 -> 128 and odd head counts
    t64 = t.to(tl.int64)
    k = tl.load(key + t64 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + t64 * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_ct + h * stride_ch + d
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store key/value [tokens, kv_heads, head_dim] into slot_mapping[t] of the caches (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The kernel addresses the innermost dim with unit stride (true for slices of a fused qkv).
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K/V caches: same strides, unit last"
    block_size = k_cache.shape[1]
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4)


# --- copy_blocks -----------------------------------------------------------------------------
# All cache tensors (2 per layer) are copied in ONE launch: their base addresses go into an int64
# table, and each program reads its tensor's address from it.  A copy is bitwise, so the element
# type only sets the access width: the widest of 8/4/2/1 bytes that divides the block size and the
# base address (an fp16 cache block of 16 x 8 x 128 moves as 4096 int64 words).  Caches of
# different widths or block sizes form separate groups, one launch each.  The loaded addresses
# carry no alignment facts for the compiler, which is why the width is chosen on the host.
#
#   grid = (pair i, cache c, chunk j)     src = table[c] + src_ids[i] * block_words + j*CHUNK + arange
#                                         dst = table[c] + dst_ids[i] * block_words + j*CHUNK + arange

_COPY_CHUNK = 1024
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(ptr_table, template, src_ids, dst_ids, block_words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    j = tl.program_id(2)
    base = tl.load(ptr_table + c).to(template.dtype)  # int64 address -> pointer to the word type
    src = tl.load(src_ids + i).to(tl.int64)
    dst = tl.load(dst_ids + i).to(tl.int64)
    offs = j * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_words
    x = tl.load(base + src * block_words + offs, mask=mask)
    tl.store(base + dst * block_words + offs, x, mask=mask)


def copy_blocks_triton(caches: list[torch.Tensor], src_block_ids: torch.Tensor,
                       dst_block_ids: torch.Tensor) -> None:
    """For every cache tensor [blocks, ...], copy block src_block_ids[i] over dst_block_ids[i].

    Pairs must not chain (a dst that is also a src): the copies run in parallel.  Copy-on-write
    guarantees it (destinations are freshly allocated blocks).
    """
    num_pairs = src_block_ids.numel()
    if num_pairs == 0 or not caches:
        return
    device = caches[0].device
    src = src_block_ids.to(device=device, dtype=torch.int64)
    dst = dst_block_ids.to(device=device, dtype=torch.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for cache in caches:
        assert cache.device == device, "all caches on one device"
        if not cache.is_contiguous():  # blocks must be contiguous slabs
            cache.index_copy_(0, dst, cache.index_select(0, src))
            continue
        block_bytes = cache[0].numel() * cache.element_size()
        width = next(w for w in (8, 4, 2, 1) if block_bytes % w == 0 and cache.data_ptr() % w == 0)
        groups.setdefault((width, block_bytes // width), []).append(cache.data_ptr())
    for (width, block_words), ptrs in groups.items():
        table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        template = torch.empty(1, dtype=_INT_OF_WIDTH[width], device=device)  # only its type is used
        grid = (num_pairs, len(ptrs), triton.cdiv(block_words, _COPY_CHUNK))
        _copy_blocks_kernel[grid](table, template, src, dst, block_words, CHUNK=_COPY_CHUNK, num_warps=4)
