"""Torch reference implementations of the paged ops: the CPU path, and the oracle for kernel tests.

See ops/attention.py for the cache layout and the meaning of every argument.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Tokens first .. length-1 of one sequence as a contiguous [length - first, kv_heads, head_dim];
    blocks wholly before `first` are not read (they may have left the sliding window and been freed)."""
    block_size = cache.shape[1]
    first_block, num_blocks = first // block_size, -(-length // block_size)
    blocks = cache.index_select(0, block_table[first_block:num_blocks].long())
    skip = first - first_block * block_size
    return blocks.reshape(-1, *cache.shape[2:])[skip:length - first_block * block_size]


# A decode bucket stops growing once padding would make it gather this much more than it uses.
_MAX_PADDING = 1.3
_MIN_BUCKET = 8


def _length_buckets(rows: list[int], seq_lens_list: list[int]) -> list[list[int]]:
    """Decode rows grouped by similar context length, so a padded gather wastes little."""
    buckets, current, used = [], [], 0
    for r in sorted(rows, key=lambda r: seq_lens_list[r]):
        length = seq_lens_list[r]
        # sorted ascending: `length` is the bucket's padded length if r joins it
        if len(current) >= _MIN_BUCKET and length * (len(current) + 1) > _MAX_PADDING * (used + length):
            buckets.append(current)
            current, used = [], 0
        current.append(r)
        used += length
    if current:
        buckets.append(current)
    return buckets


def first_visible(pos, sliding_window=None, chunk=None):
    """The first key position a query at `pos` sees (an int or a tensor of positions): with a window W,
    pos - W + 1; with attention chunks of C positions (Llama 4), the start of pos's chunk; else 0."""
    first = pos * 0
    if sliding_window:
        first = first + pos - sliding_window + 1
    if chunk:
        first = torch.maximum(first, pos // chunk * chunk) if torch.is_tensor(pos) else max(first, pos // chunk * chunk)
    return first.clamp(min=0) if torch.is_tensor(first) else max(0, first)


def _attend(q, keys, values, mask, scale, softcap=None, is_causal=False, sinks=None, bias=None):
    """SDPA over [batch, heads, q_len, dim] with GQA; explicitly when the scores need more than a
    mask: a soft-cap (Gemma 2: cap * tanh(scores / cap)), an additive bias (ALiBi), or attention sinks
    (GPT-OSS: one logit per head that joins the softmax's denominator and adds no value)."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if softcap is None and sinks is None and bias is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float()
    if bias is not None:
        scores = scores + bias
    if is_causal:
        mask = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(q.dtype), values)


def _alibi(slopes, q_pos, k_pos):
    """The ALiBi bias [.., heads, q, k] slope_h * (k - q) for query positions q_pos [.., q] and key
    positions k_pos [.., k] (leading dimensions broadcast)."""
    distance = (k_pos[..., None, :] - q_pos[..., :, None]).float()
    return slopes.float().view(-1, 1, 1) * distance.unsqueeze(-3)


def _decode_batch(query, k_cache, v_cache, block_tables, seq_lens_list, rows, scale, sliding_window=None,
                  softcap=None, *, sinks=None, alibi=None, chunk=None):
    """One query token per sequence: gather the contexts padded to the longest, mask the padding."""
    block_size = k_cache.shape[1]
    lens_list = [seq_lens_list[r] for r in rows]
    idx = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
    table_rows = block_tables.index_select(0, idx)
    lens = torch.tensor(lens_list, device=query.device)
    if sliding_window or chunk:
        # the query sits at len - 1 and sees positions first_visible(len - 1) .. len - 1: gather from
        # the block holding the first on (earlier blocks may have been freed and hold another sequence's KV)
        begins = [first_visible(n - 1, sliding_window, chunk) for n in lens_list]
        first_blocks = [b // block_size for b in begins]
        max_blocks = max(-(-n // block_size) - f for n, f in zip(lens_list, first_blocks))
        first = torch.tensor(first_blocks, dtype=torch.long, device=block_tables.device)
        cols = (first[:, None] + torch.arange(max_blocks, device=block_tables.device)[None, :])
        # columns past a row's table end only pad a shorter row: clamped, then masked as padding
        tables = table_rows.gather(1, cols.clamp(max=table_rows.shape[1] - 1)).reshape(-1).long()
        positions = (first.to(query.device)[:, None] * block_size
                     + torch.arange(max_blocks * block_size, device=query.device)[None, :])
        begin = torch.tensor(begins, device=query.device)
        mask = (positions < lens[:, None]) & (positions >= begin[:, None])
    else:
        max_blocks = -(-max(lens_list) // block_size)
        # index_select of whole blocks copies contiguous rows: much faster than advanced indexing
        tables = table_rows[:, :max_blocks].reshape(-1).long()
        positions = torch.arange(max_blocks * block_size, device=query.device)[None, :].expand(len(rows), -1)
        mask = positions < lens[:, None]
    num = len(rows)
    # [seqs * blocks, block_size, kv_heads, dim] -> [seqs, kv_heads, padded_len, dim]
    keys = k_cache.index_select(0, tables).view(num, max_blocks * block_size, *k_cache.shape[2:]).transpose(1, 2)
    values = v_cache.index_select(0, tables).view(num, max_blocks * block_size, *v_cache.shape[2:]).transpose(1, 2)
    q = query.unsqueeze(2)  # [seqs, heads, 1, dim]
    bias = None if alibi is None else _alibi(alibi, (lens - 1)[:, None], positions)
    out = _attend(q, keys, values, mask[:, None, None, :], scale, softcap, sinks=sinks, bias=bias)
    return out.squeeze(2)


def extend_one(query, k_cache, v_cache, block_table, seq_len, scale, sliding_window=None, softcap=None, *,
               sinks=None, alibi=None, chunk=None):
    """Several query tokens of one sequence, the last q_len of its context, causally masked (and
    within the sliding window: query at position i sees keys i - window < j <= i; within its chunk)."""
    q_len = query.shape[0]
    # keys below the first query's window or chunk are seen by no query: not gathered at all
    # (nor read: they may have left the window and been freed)
    first = first_visible(seq_len - q_len, sliding_window, chunk)
    keys = gather_context(k_cache, block_table, seq_len, first).transpose(0, 1)[None]
    values = gather_context(v_cache, block_table, seq_len, first).transpose(0, 1)[None]
    q = query.transpose(0, 1)[None]  # [1, heads, q_len, dim]
    plain = not (sliding_window or chunk or alibi is not None)
    if q_len == seq_len and plain:   # a whole prompt: plain causal, no mask to build and read
        return _attend(q, keys, values, None, scale, softcap, is_causal=True, sinks=sinks)[0].transpose(0, 1)
    # query i sits at position seq_len - q_len + i and sees keys j <= that position
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(first, seq_len, device=query.device)
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= first_visible(q_pos, sliding_window, chunk)[:, None])
    bias = None if alibi is None else _alibi(alibi, q_pos, k_pos)[None]
    return _attend(q, keys, values, mask, scale, softcap, sinks=sinks, bias=bias)[0].transpose(0, 1)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=None, sliding_window=None, softcap=None, *, sinks=None, alibi=None, chunk=None):
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    seq_lens_list = seq_lens.tolist()
    variant = dict(sinks=sinks, alibi=alibi, chunk=chunk)
    decode_rows, decode_tokens = [], []
    for s, seq_len in enumerate(seq_lens_list):
        start, end = starts[s], starts[s + 1]
        if end - start == 1:
            decode_rows.append(s)
            decode_tokens.append(start)
        elif end > start:
            out[start:end] = extend_one(query[start:end], k_cache, v_cache, block_tables[s], seq_len, scale,
                                        sliding_window, softcap, **variant)
    token_of = dict(zip(decode_rows, decode_tokens))
    for bucket in _length_buckets(decode_rows, seq_lens_list):
        tok = torch.tensor([token_of[r] for r in bucket], dtype=torch.long, device=query.device)
        out[tok] = _decode_batch(query.index_select(0, tok), k_cache, v_cache, block_tables,
                                 seq_lens_list, bucket, scale, sliding_window, softcap, **variant)
    return out


def copy_blocks(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in every cache tensor (copy-on-write)."""
    src, dst = src.long(), dst.long()
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))
