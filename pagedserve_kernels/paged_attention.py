"""Triton paged attention: picks the decode kernel or the prefill/extend kernel for a batch.

Semantics are exactly those of ``ops.reference.paged_attention`` (see ops/attention.py):
query [tokens, heads, head_dim] is a flattened varlen batch; the query tokens of sequence s are
the last q_len of its seq_lens[s] context and attend causally (within a sliding window, with a
soft-cap on the scores, ALiBi, attention sinks, within attention chunks, when given); kv heads divide
query heads.

    pure decode (every q_len <= 1)  -> pagedserve_kernels.paged_decode   split-K over the context + reduction
    anything else (mixed batches)   -> pagedserve_kernels.paged_prefill  one varlen launch, q_len 1 rows included
"""
from __future__ import annotations

import torch

from pagedserve_kernels.paged_decode import paged_decode
from pagedserve_kernels.paged_prefill import paged_prefill


def _is_pure_decode(num_tokens: int, query_start_loc: torch.Tensor, max_query_len: int | None) -> bool:
    if max_query_len is not None:
        return max_query_len <= 1
    if num_tokens != query_start_loc.shape[0] - 1:
        return False  # more tokens than sequences: some q_len > 1 (fewer: prefill handles q_len 0)
    # Same count could still hide a q_len 0 next to a q_len 2: look (a device sync, only when the
    # caller did not pass max_query_len).
    return bool(((query_start_loc[1:] - query_start_loc[:-1]) == 1).all())


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, max_query_len: int | None = None, *,
                           partition_size: int | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           alibi: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Causal paged attention; returns a tensor shaped like query.

    partition_size (decode only) overrides the context split, in tokens; tests use it to exercise
    the split-K reduction on short contexts.  Default: chosen from the batch and the GPU size.
    """
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K/V caches: same strides, unit last"
    assert query.shape[1] % k_cache.shape[2] == 0, "kv heads must divide query heads"
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    variant = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, alibi=alibi, chunk=chunk)
    if _is_pure_decode(query.shape[0], query_start_loc, max_query_len):
        paged_decode(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                     partition_size=partition_size, **variant)
    else:
        paged_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                      max_query_len=max_query_len, **variant)
    return out
