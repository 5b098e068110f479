"""Paged prefill/extend attention: a varlen batch of query runs, causal over the paged context.

One launch for the whole batch, no padding between sequences.  The grid is (query tile, kv head);
a tile holds BLOCK_Q consecutive query tokens of ONE sequence times all BLOCK_G query heads of the
kv head's group (so K/V tiles are shared by the group), flattened into BLOCK_M = BLOCK_Q * BLOCK_G
rows for tl.dot:

    q_lens     :  5          1    9                (BLOCK_Q = 4)
    tiles      :  [0 1]      [2]  [3 4 5]
    cu_tiles   :  0          2    3       6        cumsum of cdiv(q_len, BLOCK_Q), built on the device
    tile t -> sequence s = #{s : cu_tiles[s + 1] <= t}
              first query row q0 = (cu_tiles[s + 1] - 1 - t) * BLOCK_Q: a sequence's tiles run in
              reverse, its last rows (most keys under the causal mask) start first
    row r of the tile -> query token q0 + r // BLOCK_G, head kvh * group + r % BLOCK_G

The grid size is an upper bound, cdiv(tokens, BLOCK_Q) + seqs, known without reading query lengths
back to the host (no device sync); programs past the last tile return at once.

Query token i of a sequence sits at position ctx + i with ctx = seq_len - q_len, and sees keys
0 .. ctx + i.  Key tiles below ctx + q0 + 1 are visible to every row of the tile and run without
the causal mask; the rest (up to the tile's last query position) run with it:

    keys:  [0 ............ full_end)[full_end .... kv_end)
            no mask (most of a long prefix)   causal mask

With a sliding window W a query at position i sees keys i - W < j <= i: the scan starts at the tile's
lowest visible key, ctx + q0 - W + 1, and both ranges also mask keys below each row's window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve_kernels.paged_common import (LOG2E, dot_config, kv_row_offsets, next_pow2, per_head_base2, score_args,
                                  soft_cap, variant_args)

# (rows = query tokens x group heads, keys per inner step, warps, pipeline stages) per program.
# float32 runs its "ieee" tl.dot on FMA units: register-hungry, it spills a little on sm_90 at any
# tile size; the smallest spill was 32 x 32 on 8 warps.  float32 is for checking, not for serving speed.
TILE = {torch.float16: (64, 64, 4, 2), torch.bfloat16: (64, 64, 4, 2), torch.float32: (32, 32, 8, 2)}
# Each program scans the batch's tile ends to find its sequence, over a power-of-two vector (a
# compile-time size); one size for every batch up to 256 sequences means one compiled variant.
MIN_BLOCK_S = 256


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, k_cache, v_cache, table_row, head_off, lo, hi, qk_scale,
            softcap, window, chunk_start, slopes, stride_cb, stride_ct, d, dmask,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            HAS_ALIBI: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Online-softmax step over keys [lo, hi) of one sequence (hi <= its length)."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = kv_row_offsets(table_row, pos, valid, stride_cb, stride_ct, BLOCK_SIZE) + head_off
        k = tl.load(k_cache + rows[None, :] + d[:, None], mask=valid[None, :] & dmask[:, None],
                    other=0.0).to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if HAS_SOFTCAP:
            scores = soft_cap(scores, softcap) * LOG2E
        if HAS_ALIBI:
            scores += slopes[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        keep = valid[None, :]  # without CAUSAL only the tail of the last step can be past hi
        if CAUSAL:
            keep = keep & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        if HAS_CHUNK:
            keep = keep & (pos[None, :] >= chunk_start[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :],
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


# Runtime-varying integers are not specialized (see pagedserve_kernels/paged_decode.py): no recompiles as the
# batch and the block-table width change from step to step.
@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "window", "chunk"])
def _prefill_kernel(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, cu_tiles, out,
                    qk_scale, softcap, window, sinks, alibi, chunk, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_ct, stride_ch, num_seqs, group, head_dim,
                    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_CHUNK: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    # tile -> sequence (see the module docstring)
    i = tl.arange(0, BLOCK_S)
    tile_ends = tl.load(cu_tiles + 1 + i, mask=i < num_seqs, other=0x7FFFFFFF)
    s = tl.sum((tile_ends <= t).to(tl.int32), axis=0)
    if s >= num_seqs:
        return
    # tiles of a sequence run last-rows-first: causal rows near the end see the most keys, and
    # starting the longest programs early shortens the tail of the launch
    q0 = (tl.load(cu_tiles + s + 1) - 1 - t) * BLOCK_Q
    q_start = tl.load(query_start_loc + s)
    q_len = tl.load(query_start_loc + s + 1) - q_start
    seq_len = tl.load(seq_lens + s)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // BLOCK_G
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim                                   # head_dim 80 padded to 128
    row_mask = (qi < q_len) & (g < group)
    heads = kvh * group + g
    tok = (q_start + qi).to(tl.int64)
    io_mask = row_mask[:, None] & dmask[None, :]
    q = tl.load(query + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + qi

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked tiles give 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINKS:  # the sink is one more key with no value row
        m_i = per_head_base2(sinks, heads, row_mask)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    slopes = m_i
    if HAS_ALIBI:
        slopes = per_head_base2(alibi, heads, row_mask)
    chunk_start = q_pos
    if HAS_CHUNK:
        chunk_start = q_pos // chunk * chunk
    table_row = block_tables + s.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    full_end = ((ctx + q0 + 1) // BLOCK_N) * BLOCK_N
    kv_end = ctx + tl.minimum(q0 + BLOCK_Q, q_len)
    lo = 0
    if HAS_WINDOW:  # the tile's first row (ctx + q0) sees keys from ctx + q0 - window + 1 on
        lo = tl.maximum(0, ctx + q0 - window + 1)
    if HAS_CHUNK:  # ... and its chunk, which starts no later than any other row's
        lo = tl.maximum(lo, (ctx + q0) // chunk * chunk)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_cache, v_cache, table_row, head_off, lo, full_end,
                            qk_scale, softcap, window, chunk_start, slopes, stride_cb, stride_ct, d, dmask,
                            BLOCK_SIZE, BLOCK_N, DOT_PREC, False, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_CHUNK)
    # a window narrower than a key tile can start past full_end: keys before lo are never loaded (their
    # blocks may have left the window and been freed; a masked NaN there would still poison P @ V)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, k_cache, v_cache, table_row, head_off,
                            tl.maximum(full_end, lo), kv_end,
                            qk_scale, softcap, window, chunk_start, slopes, stride_cb, stride_ct, d, dmask,
                            BLOCK_SIZE, BLOCK_N, DOT_PREC, True, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_CHUNK)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             res.to(out.dtype.element_ty), mask=io_mask)


def paged_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                  max_query_len: int | None = None, sliding_window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  alibi: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """Causal varlen attention into `out`; any q_len >= 0 per sequence. sliding_window, softcap, sinks,
    alibi and chunk as in ops.attention.paged_attention."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_g = next_pow2(group)
    block_rows, block_n, num_warps, num_stages = TILE.get(query.dtype, TILE[torch.float16])
    block_q = max(1, block_rows // block_g)
    block_m = block_q * block_g  # >= 16 as tl.dot needs
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    cu_tiles = torch.zeros(num_seqs + 1, dtype=torch.int32, device=query.device)
    cu_tiles[1:] = torch.cumsum((q_lens + block_q - 1) // block_q, dim=0)
    num_tiles = triton.cdiv(num_tokens, block_q) + num_seqs
    if max_query_len is not None:
        num_tiles = min(num_tiles, num_seqs * triton.cdiv(max_query_len, block_q))
    if num_tiles == 0:
        return
    precision, upcast = dot_config(query.dtype, query.device)
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, cu_tiles, out,
        *score_args(scale, sliding_window, softcap), *variant_args(query, sinks, alibi, chunk), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_seqs, group, head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=next_pow2(head_dim), BLOCK_S=max(MIN_BLOCK_S, next_pow2(num_seqs)), UPCAST=upcast,
        DOT_PREC=precision, HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None, HAS_ALIBI=alibi is not None, HAS_CHUNK=bool(chunk),
        num_warps=num_warps, num_stages=num_stages)
