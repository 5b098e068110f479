"""Paged attention ops: shape checks, then dispatch: Triton on CUDA; on CPU the C++ decode kernel
(kernels/cpu, float32) for one-token rows and the torch reference for the rest.

Cache layout, one tensor per layer and per K/V:

    cache[num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset``; slot -1 is padding and is skipped.

The flattened batch of one step holds, for sequence ``s``, the query tokens
``query_start_loc[s] : query_start_loc[s + 1]``. These are the *last* ``q_len`` tokens of the
sequence's context of ``seq_lens[s]`` tokens (their K/V were written to the cache before the
attention call), so query token ``i`` of ``s`` sits at position ``seq_lens[s] - q_len + i`` and
attends causally to positions ``0 .. that position``::

    context of s:  [ t0 t1 t2 ... t(L-q) | t(L-q+1) ... t(L-1) ]
                     cached by earlier     query tokens of this step
                     steps (or prefix)     (written just before)
"""
from __future__ import annotations

import os

import torch

from ops import cpu_kernels, reference


def use_triton(device: torch.device) -> bool:
    # PAGEDSERVE_TRITON=1 forces the Triton path (with TRITON_INTERPRET=1 on CPU, for tests);
    # PAGEDSERVE_TRITON=0 forces the torch reference even on CUDA.
    forced = os.environ.get("PAGEDSERVE_TRITON")
    if forced is not None:
        return forced == "1"
    return device.type == "cuda"


def backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which implementation serves attention for this device and dtype (builds the CPU kernel if needed)."""
    if use_triton(device):
        return "triton"
    if _cpu_kernel(device, dtype) is not None:
        return "cpu kernel for decode rows, torch reference for prompts"
    if device.type != "cpu":
        why = "Triton turned off by PAGEDSERVE_TRITON=0"
    elif not cpu_kernels.enabled():
        why = "disabled by PAGEDSERVE_CPU_KERNELS=0"
    else:
        why = cpu_kernels.failure() or f"the CPU kernel is float32 only, not {dtype}"
    return f"torch reference ({why})"


def _cpu_kernel(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return cpu_kernels.load()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4, f"cache must be [blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, "K and V caches differ in shape"


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store key/value [tokens, kv_heads, head_dim] into their slots (slot -1: skipped)."""
    _check_cache(k_cache, v_cache)
    assert key.shape == value.shape and key.dim() == 3, f"key must be [tokens, kv_heads, head_dim], got {tuple(key.shape)}"
    assert key.shape[1:] == k_cache.shape[2:], "key heads/dim do not match the cache"
    assert slot_mapping.shape == (key.shape[0],), "one slot per token"
    if use_triton(key.device):
        from kernels.cache_ops import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    kernel = _cpu_kernel(key.device, key.dtype) if k_cache.dtype == key.dtype else None
    if kernel is not None and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value)) \
            and k_cache.is_contiguous() and v_cache.is_contiguous():
        # one call, no read-back of the slots (the reference masks padding with a device sync)
        kernel.write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int | None = None, *, sliding_window: int | None = None,
                    softcap: float | None = None, decode_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [tokens, heads, head_dim] over the paged cache; returns the same shape.

    block_tables: int32 [seqs, max_blocks] (unused entries any value, conventionally 0);
    seq_lens: int32 [seqs], context length including this step's tokens;
    query_start_loc: int32 [seqs + 1], cumulative query lengths.
    max_query_len: the longest query of the batch if the caller knows it (1 means pure decode).
    sliding_window: W > 0 lets the query at position i see only keys i - W < j <= i (transformers'
        convention: W positions, its own included); None or 0: the whole causal context.
    softcap: c > 0 turns each scaled score s into c * tanh(s / c) before the softmax (Gemma 2).
    decode_rows: `decode_rows(query_start_loc)` when the caller made it once for the step (the CPU
        kernel's input; every layer of a step would otherwise make it again).
    """
    _check_cache(k_cache, v_cache)
    assert query.dim() == 3 and query.shape[2] == k_cache.shape[3], "query must be [tokens, heads, head_dim]"
    assert query.shape[1] % k_cache.shape[2] == 0, "query heads must be a multiple of kv heads"
    num_seqs = seq_lens.shape[0]
    assert block_tables.shape[0] == num_seqs and query_start_loc.shape[0] == num_seqs + 1
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    sliding_window, softcap = sliding_window or None, softcap or None
    if use_triton(query.device):
        from kernels.paged_attention import paged_attention_triton
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                      scale, max_query_len, sliding_window=sliding_window, softcap=softcap)
    kernel = _cpu_kernel(query.device, query.dtype) if k_cache.dtype == query.dtype else None
    if kernel is not None:
        return _paged_attention_cpu(kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                    scale, max_query_len, sliding_window, softcap, decode_rows)
    return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     scale, max_query_len, sliding_window, softcap)


def decode_rows(query_start_loc: torch.Tensor) -> torch.Tensor:
    """int64 [R, 2]: (query row, sequence) of every sequence with one query token this step."""
    starts = query_start_loc.long()
    decode = torch.nonzero(starts[1:] - starts[:-1] == 1).squeeze(1)
    return torch.stack([starts[:-1].index_select(0, decode), decode], dim=1).contiguous()


def _paged_attention_cpu(kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                         max_query_len, sliding_window=None, softcap=None, rows=None):
    """Decode rows (one query token) in the C++ kernel, straight from the blocks; prompt and chunk
    rows through the reference, whose causal SDPA over a gathered context is already efficient."""
    out = torch.empty_like(query)
    rows = decode_rows(query_start_loc) if rows is None else rows
    if rows.numel():
        # 0 means none to the kernel
        kernel.paged_decode(out, query, k_cache.contiguous(), v_cache.contiguous(),
                            block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
                            rows, float(scale), int(sliding_window or 0), float(softcap or 0.0))
    if max_query_len is None or max_query_len > 1:
        starts = query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]
        seq_len_list, start_list = seq_lens.tolist(), starts.tolist()
        for s in torch.nonzero(q_lens > 1).squeeze(1).tolist():
            begin, end = start_list[s], start_list[s + 1]
            out[begin:end] = reference.extend_one(query[begin:end], k_cache, v_cache, block_tables[s],
                                                  seq_len_list[s], scale, sliding_window, softcap)
    return out
