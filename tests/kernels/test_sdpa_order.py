"""The attention kernel's bfloat16 rows with their two products in MKL's order (ops/sdpa_order.py): which
call of transformers' each row belongs to, and, where the start-up check finds that the order gives torch's
bits, transformers' attention bit for bit: prompts in chunks, decode rows, a mixed batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import attention, sdpa_order


def test_a_prompts_rows_are_one_call_over_the_prompt_in_blocks_of_torchs_queries():
    # a 70-token prompt: torch's flash attention splits its 70 queries into blocks of 32, 32 and 6
    ends, rows = attention.transformers_calls(torch.arange(70), torch.full((70,), 70))
    assert ends.tolist() == [70] * 70
    assert rows.tolist() == [32] * 64 + [6] * 6
    # from 192 queries on, blocks of 64: a 200-token prompt's last block holds 8
    _, rows = attention.transformers_calls(torch.tensor([0, 127, 128, 191, 192, 199]), torch.full((6,), 200))
    assert rows.tolist() == [64, 64, 64, 64, 8, 8]


def test_every_token_after_the_prompt_is_a_call_of_its_own():
    ends, rows = attention.transformers_calls(torch.tensor([9, 10, 57]), torch.full((3,), 10))
    assert ends.tolist() == [10, 11, 58] and rows.tolist() == [10, 1, 1]


def test_a_prompt_in_chunks_keeps_the_calls_of_the_whole_prompt():
    # the second chunk (positions 40..69) of a 70-token prompt, beside a decode row at position 12 of a
    # sequence whose prompt was 5 tokens
    starts = torch.tensor([0, 30, 31], dtype=torch.int32)
    seq_lens = torch.tensor([70, 13], dtype=torch.int32)
    tables = torch.zeros(2, 8, dtype=torch.int32)
    rows = attention.kernel_rows(starts, seq_lens, tables, prompt_lens=torch.tensor([70, 5], dtype=torch.int32))
    assert rows.lens.tolist() == list(range(41, 71)) + [13]
    assert rows.ends.tolist() == [70] * 30 + [13]
    assert rows.qrows.tolist() == [32] * 24 + [6] * 6 + [1]
    # without the prompts' lengths: one call over each sequence's length after the step
    plain = attention.kernel_rows(starts, seq_lens, tables)
    assert plain.ends.tolist() == [70] * 30 + [13] and plain.qrows.tolist() == [32] * 24 + [6] * 6 + [1]
    # a step of one new token per sequence, the first a prompt's last token that came alone
    alone = attention.decode_rows(torch.arange(2), tables, seq_lens, torch.tensor([70, 5], dtype=torch.int32))
    assert alone.ends.tolist() == [70, 13] and alone.qrows.tolist() == [6, 1]


def _case_rows(kernel, lanes, mkl):
    return [(sdpa_order.kernel_attention(kernel, args, lanes, mkl), expected)
            for args, expected in (sdpa_order.sdpa_case(q, k, seed=k + 1) for q, k in sdpa_order.CHECK_CASES)]


def test_the_start_up_check_and_the_kernels_rows_agree(kernel):
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    if not lanes:
        assert not attention.choose(torch.device("cpu"), torch.bfloat16).mkl_order
        return
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    # on other seeds than the check's, the kernel's rows in MKL's order are SDPA's on every case exactly
    # where the check chose that order
    results = _case_rows(kernel, lanes, True)
    assert chosen.mkl_order == all(torch.equal(got, expected) for got, expected in results)
    if chosen.mkl_order:
        # and the order matters: in the kernel's own order some values are not SDPA's
        assert any(not torch.equal(got, expected) for got, expected in _case_rows(kernel, lanes, False))


def test_a_mixed_batch_in_mkl_order_gives_each_row_its_own_result(kernel):
    # decode rows past one and two blocks of 512 keys, and prompts, their blocks shuffled in the pool: each
    # sequence's rows are the same in the batch as alone, and (where the order is MKL's) SDPA's bit for bit
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    seq_lens, q_lens = [37, 150, 9, 600, 51, 3, 1030], [1, 1, 9, 1, 51, 3, 1]
    blocks = sum(-(-s // bs) for s in seq_lens) + 3
    k_cache, v_cache = (torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    order = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), 80, dtype=torch.int32)
    used = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = order[used:used + n]
        used += n
    query = torch.randn(sum(q_lens), heads, dim, generator=gen).to(torch.bfloat16)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(q, st, sl, tb):
        return attention.paged_attention(q, k_cache, v_cache, tb, sl, st, dim ** -0.5, int((st[1:] - st[:-1]).max()),
                                         backend=chosen)

    together = run(query, starts, lens, tables)
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        a, b = int(starts[i]), int(starts[i + 1])
        alone = run(query[a:b].contiguous(), torch.tensor([0, n], dtype=torch.int32), lens[i:i + 1],
                    tables[i:i + 1].contiguous())
        assert torch.equal(together[a:b], alone)
        if chosen.mkl_order:
            pos = torch.arange(s)
            k, v = (c[tables[i, pos // bs].long(), pos % bs] for c in (k_cache, v_cache))
            expected = F.scaled_dot_product_attention(
                query[a:b].transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(3, 0)[None],
                v.transpose(0, 1).repeat_interleave(3, 0)[None], scale=dim ** -0.5, is_causal=n > 1)[0].transpose(0, 1)
            assert torch.equal(alone, expected), f"sequence {i}"


def test_query_rows_must_come_with_ends(kernel):
    args, _ = sdpa_order.sdpa_case(1, 20, seed=3)
    query, k_cache, v_cache, tables, seq_lens, starts, scale, _ = args
    rows = attention.kernel_rows(starts, seq_lens, tables)
    with pytest.raises(RuntimeError, match="qrows"):
        kernel.paged_decode(torch.empty_like(query), query, k_cache, v_cache, rows.tables, rows.lens, rows.tokens,
                            float(scale), 0, 0.0, None, None, 0, None, 16, rows.qrows)
