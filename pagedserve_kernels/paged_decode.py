"""Paged decode attention (one query token per sequence), flash-decoding style.

A program owns (sequence s, kv head h, context partition p) and ALL query heads of h's group, so
each K/V tile is read from the cache once per group (GQA/MQA):

    context of s:  |<- PARTITION ->|<- PARTITION ->|<- PARTITION ->|..|   p = 0, 1, 2, ...
                   | BLOCK_N | ... |                                       inner loop, online softmax
    partition p -> part_m[s, head, p] (running max, base 2), part_l (sum of exp), part_out (acc / l)

A second kernel folds the partitions of each (s, head):  w_p = l_p * 2^(m_p - max m),
out = sum_p w_p * o_p / sum_p w_p.  When the (s, h) programs alone fill the GPU the split is not
worth it: then there is one partition and the first kernel writes the output itself (no scratch,
no second launch).

Query rows of the group are padded to BLOCK_G >= 16 for tl.dot (tensor cores need M >= 16; decode
is bound by reading K/V, so the idle rows cost nothing that matters).  Plain multi-head attention
(group 1) skips tl.dot: a [1, D] x [D, N] product is an elementwise multiply and a tl.sum, kept
2-D (compiled for sm_90: 96 registers at head_dim 128, against 211 for a [1, D, N] broadcast).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels.paged_common import (LOG2E, dot_config, kv_row_offsets, next_pow2, per_head_base2, score_args,
                                  soft_cap, variant_args)

BLOCK_N = 64            # context tokens per inner step (spans one or more cache blocks)
MIN_PARTITION = 256     # below this a partition's fixed cost outweighs the parallelism it adds
_SINGLE = 1 << 30       # "partition" length meaning: the whole context, no split
MIN_BLOCK_P = 16        # the reduction's partition vector: one compiled variant up to 16 partitions


# Runtime-varying integers are not specialized: Triton would otherwise compile a new variant when
# one of them becomes 1 or a multiple of 16 (the block-table width does as contexts grow), and each
# compile stalls the serving loop for up to a second on a GPU.
_VARYING = ["partition", "stride_bt", "num_parts", "window", "chunk"]


@triton.jit(do_not_specialize=_VARYING)
def _decode_kernel(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                   part_out, part_m, part_l, qk_scale, softcap, window, sinks, alibi, chunk, partition,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_cb, stride_ct, stride_ch,
                   num_heads, num_parts, group, head_dim,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_PREC: tl.constexpr, SINGLE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_CHUNK: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(seq_lens + s)
    tok = tl.load(query_start_loc + s)
    q_len = tl.load(query_start_loc + s + 1) - tok
    start = p * partition
    if (start >= seq_len) | (q_len == 0):  # partition past the end, or no query this step
        return
    end = tl.minimum(start + partition, seq_len)
    lo = start
    if HAS_WINDOW:  # the query (at seq_len - 1) sees the last `window` positions; earlier ones are skipped
        lo = tl.maximum(start, seq_len - window)
    if HAS_CHUNK:  # ... and only its own chunk
        lo = tl.maximum(lo, (seq_len - 1) // chunk * chunk)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    gmask = g < group
    dmask = d < head_dim                                  # head_dim 80 padded to 128
    q_ptrs = query + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # finite initial max: a fully masked tile then gives exp2(-inf) = 0, never inf - inf = NaN
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if HAS_SINKS:  # the sink is one more key with no value row, counted once: in partition 0
        m_i = tl.where(p == 0, per_head_base2(sinks, heads, gmask), m_i)
        l_i = tl.where(p == 0, 1.0, l_i)
    if HAS_ALIBI:
        slopes = per_head_base2(alibi, heads, gmask)
    table_row = block_tables + s.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        rows = kv_row_offsets(table_row, pos, valid, stride_cb, stride_ct, BLOCK_SIZE) + head_off
        kv_mask = valid[None, :] & dmask[:, None]
        # K loaded transposed, [BLOCK_D, BLOCK_N], ready for q @ k
        k = tl.load(k_cache + rows[None, :] + d[:, None], mask=kv_mask, other=0.0).to(q.dtype)
        if USE_DOT:
            scores = tl.dot(q, k, input_precision=DOT_PREC)
        else:
            # BLOCK_G == 1: [D, 1] * [D, N] summed over D, kept 2-D (a 3-D product costs registers)
            scores = tl.sum(tl.trans(q.to(tl.float32)) * k.to(tl.float32), axis=0)[None, :]
        scores = scores * qk_scale
        if HAS_SOFTCAP:
            scores = soft_cap(scores, softcap) * LOG2E
        if HAS_ALIBI:
            scores += slopes[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v_mask = valid[:, None] & dmask[None, :]
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=v_mask, other=0.0).to(q.dtype)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.sum(tl.trans(prob) * v.to(tl.float32), axis=0)[None, :]
        m_i = m_new

    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SINGLE:
        o_ptrs = out + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=omask)
    else:
        # scratch [seqs, heads, num_parts] (+ [head_dim] for part_out), float32, contiguous
        slot = (s.to(tl.int64) * num_heads + heads) * num_parts + p
        tl.store(part_m + slot, m_i, mask=gmask)
        tl.store(part_l + slot, l_i, mask=gmask)
        tl.store(part_out + slot[:, None] * head_dim + d[None, :], res, mask=omask)


@triton.jit(do_not_specialize=["partition", "num_parts"])
def _decode_reduce_kernel(part_out, part_m, part_l, seq_lens, query_start_loc, out, partition,
                          stride_ot, stride_oh, num_heads, num_parts, head_dim,
                          BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.load(query_start_loc + s)
    if tl.load(query_start_loc + s + 1) == tok:
        return
    seq_len = tl.load(seq_lens + s)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    pmask = p < (seq_len + partition - 1) // partition  # partitions that ran for this sequence
    slot = (s.to(tl.int64) * num_heads + h) * num_parts + p
    m = tl.load(part_m + slot, mask=pmask, other=float("-inf"))
    l = tl.load(part_l + slot, mask=pmask, other=0.0)
    w = tl.where(pmask, l * tl.exp2(m - tl.max(m, axis=0)), 0.0)
    o = tl.load(part_out + slot[:, None] * head_dim + d[None, :],
                mask=pmask[:, None] & (d < head_dim)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out + tok.to(tl.int64) * stride_ot + h * stride_oh + d, res.to(out.dtype.element_ty),
             mask=d < head_dim)


def choose_partition(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Partition length (tokens) so that seqs x kv_heads x partitions fills the GPU, or _SINGLE."""
    if device.type != "cuda":
        return _SINGLE  # interpreter: parallelism buys nothing; tests pass partition_size to split
    programs_wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    base = num_seqs * num_kv_heads
    if base >= programs_wanted:
        return _SINGLE
    parts = triton.cdiv(programs_wanted, base)
    # equal shares of the context, in whole inner steps (a runtime argument: no recompiles)
    partition = max(MIN_PARTITION, triton.cdiv(triton.cdiv(max_context, parts), BLOCK_N) * BLOCK_N)
    return _SINGLE if partition >= max_context else partition


def paged_decode(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                 partition_size: int | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None,
                 alibi: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """Decode attention into `out`; every sequence has q_len <= 1 (0: skipped). sliding_window,
    softcap, sinks, alibi and chunk as in ops.attention.paged_attention."""
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    # Upper bound of any context, known without reading seq_lens back from the device (no sync):
    # programs of partitions past a sequence's end return at once.
    max_context = block_tables.shape[1] * block_size
    partition = partition_size or choose_partition(num_seqs, num_kv_heads, max_context, query.device)
    single = partition >= max_context
    num_parts = 1 if single else triton.cdiv(max_context, partition)
    if single:
        partition = _SINGLE
        part_out = part_m = part_l = out  # unused placeholders
    else:
        part_m = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32,
                               device=query.device)
    precision, upcast = dot_config(query.dtype, query.device)
    use_dot = group > 1
    block_g = max(16, next_pow2(group)) if use_dot else 1
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        part_out, part_m, part_l, *score_args(scale, sliding_window, softcap),
        *variant_args(query, sinks, alibi, chunk), partition,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, num_parts, group, head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, BLOCK_G=block_g, BLOCK_D=next_pow2(head_dim),
        USE_DOT=use_dot, UPCAST=upcast, DOT_PREC=precision, SINGLE=single, HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, HAS_ALIBI=alibi is not None,
        HAS_CHUNK=bool(chunk), num_warps=4)
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_m, part_l, seq_lens, query_start_loc, out, partition,
            out.stride(0), out.stride(1), num_heads, num_parts, head_dim,
            BLOCK_P=max(MIN_BLOCK_P, next_pow2(num_parts)), BLOCK_D=next_pow2(head_dim), num_warps=4)
