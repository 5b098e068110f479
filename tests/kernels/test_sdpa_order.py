"""The attention kernel's bfloat16 rows with their two products in MKL's order (ops/sdpa_order.py): which
call of transformers' each row belongs to, and, where the start-up check finds that the order gives torch's
bits, transformers' attention bit for bit: prompts in chunks, decode rows, a mixed batch."""
from __future__ import annotations

import os

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
    if chosen.mkl_order:
        # on other seeds than the check's, the kernel's rows in MKL's order are SDPA's on every case
        assert all(torch.equal(got, expected) for got, expected in _case_rows(kernel, lanes, True))
        # and the order matters: in the kernel's own order some values are not SDPA's
        assert any(not torch.equal(got, expected) for got, expected in _case_rows(kernel, lanes, False))
    else:
        # the check's own seeds show a case that no order the kernel knows gives (another seed may pass by luck:
        # where the orders differ, a case shows it on some inputs only)
        assert not all(torch.equal(sdpa_order.kernel_attention(kernel, args, lanes, True), expected)
                       for args, expected in (sdpa_order.sdpa_case(q, k, seed=k + offset)
                                              for q, k in sdpa_order.CHECK_CASES for offset in sdpa_order.CHECK_SEEDS))


def test_rows_in_the_order_of_mkls_amx_tiles(kernel):
    # Where MKL takes its AMX tiles, the rows of every check case (decode rows past 0, 1 and 2 blocks of 512 keys,
    # prompts) are SDPA's bit for bit in the kernel's tile order, and not all in MKL's AVX2 path's order (on
    # seeds other than the check's)
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    if not lanes or not torch.cpu._is_amx_tile_supported() or "MKL_ENABLE_INSTRUCTIONS" in os.environ:
        pytest.skip("MKL takes AMX tiles only on a CPU that has them, unless held to other instructions")
    cases = [sdpa_order.sdpa_case(q, k, seed=k + offset) for q, k in sdpa_order.CHECK_CASES for offset in (1, 5, 6)]
    before = kernel.sdpa_tile_order()
    try:
        for tiles in (True, False):
            kernel.set_sdpa_tile_order(tiles)
            equal = [torch.equal(sdpa_order.kernel_attention(kernel, args, lanes, True), expected)
                     for args, expected in cases]
            assert all(equal) if tiles else not all(equal)
    finally:
        kernel.set_sdpa_tile_order(before)
    assert attention.choose(torch.device("cpu"), torch.bfloat16).mkl_order and kernel.sdpa_tile_order()


def test_prompt_rows_of_calls_that_torch_packs_are_sdpas(kernel):
    # Where torch packs bfloat16 (AMX tiles), a prompt's call of 64 tokens or more takes oneDNN's brgemm, which sums
    # the weighted values' keys in groups of its own (125 keys: 18), and a row alone in torch's block of query rows
    # (the 513th) takes the tile order too, not a decode row's: both SDPA's bit for bit
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    if not lanes or not torch.cpu._is_amx_tile_supported() or "MKL_ENABLE_INSTRUCTIONS" in os.environ:
        pytest.skip("torch packs bfloat16 only on a CPU with AMX tiles, unless held to other instructions")
    assert attention.choose(torch.device("cpu"), torch.bfloat16).mkl_order and kernel.sdpa_tile_order()
    for prompt, seed in ((125, 126), (513, 518)):
        args, expected = sdpa_order.sdpa_case(prompt, prompt, seed=seed)
        query, k_cache, v_cache, tables, seq_lens, starts, scale, _ = args
        rows = attention.kernel_rows(starts, seq_lens, tables, max_query=prompt)
        assert rows.rest == [] and rows.qrows[-1].item() == (-1 if prompt == 513 else 29)

        def run(qrows):
            out = torch.empty_like(query)
            kernel.paged_decode(out, query, k_cache, v_cache, rows.tables, rows.lens, rows.tokens, float(scale), 0,
                                0.0, None, None, 0, rows.ends, lanes, qrows.contiguous())
            return out
        assert torch.equal(run(rows.qrows), expected), prompt
    # the 513th row as a decode row (qrows 1) is not SDPA's on this seed
    assert not torch.equal(run(rows.qrows.abs())[-1], expected[-1])


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


def _fast_exp(x: torch.Tensor) -> torch.Tensor:
    """torch's fast exponential of float32 x (as pagedserve_kernels/cpu/paged_decode.cpp's fast_exp), its
    fused multiply-adds taken in float64 (exact products; a double rounding is rare enough here)."""
    def fma(a, b, c):
        return (a.double() * b + c).float()
    y = x * torch.tensor(0x3fb8aa3b, dtype=torch.int32).view(torch.float32)
    f = y - torch.floor(y)
    r = fma(f, -0.079204240219773236, torch.tensor(-0.22433836478672356, dtype=torch.float32))
    r = fma(f, r, torch.tensor(0.30354260500649682, dtype=torch.float32))
    r = fma(f, r, torch.tensor(0.00010703434948458272, dtype=torch.float32))
    return fma(torch.full_like(y, 2.0 ** 23), y - r, torch.tensor(2.0 ** 23 * 127)).to(torch.int32).view(torch.float32)


def test_the_softmax_denominator_adds_as_torchs_kernel(kernel):
    # A decode row over 40-200 keys, its weights' denominator (the sum of the numerators) on values chosen
    # so that one float32 step of it changes the bfloat16 output: two keys carry values, the others zeros.
    # torch's built kernel adds whole vectors of numerators into two sums, alternately; one running sum
    # gave other bits in about a fifth of these rows.
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    if not lanes or not attention.choose(torch.device("cpu"), torch.bfloat16).mkl_order:
        pytest.skip("the kernel does not follow torch's SDPA steps on this CPU")
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(300):
        keys = int(torch.randint(40, 200, (1,), generator=gen))
        # one nonzero dimension: each score is one exact product, whatever the order of q.k's sum
        a = (torch.randn(1, generator=gen) * 24).to(torch.bfloat16)   # scores of a few units
        b = torch.randn(keys, generator=gen).to(torch.bfloat16)
        q = torch.zeros(1, 64, dtype=torch.bfloat16)
        k = torch.zeros(keys, 64, dtype=torch.bfloat16)
        q[0, 0], k[:, 0] = a, b
        s = (a.float() * b.float()) * 0.125
        vectors = keys // lanes * lanes
        e = torch.cat([_fast_exp(s[:vectors] - s.max()), torch.exp(s[vectors:] - s.max())])
        w = e.to(torch.bfloat16).float()
        top, second = torch.topk(e, 2).indices.tolist()
        total = e.double().sum().float()   # near torch's denominator: the values below tell ulps around it apart
        near = [total]
        for direction in (1, -1):
            t = total
            for _ in range(3):
                t = torch.nextafter(t, torch.tensor(direction * float("inf")))
                near.append(t)
        c1, c2 = (torch.randn(20000, generator=gen).to(torch.bfloat16).float() for _ in range(2))
        acc = w[top] * c1 + w[second] * c2   # (float32: one rounding, as any order of two terms)
        outs = [(acc * (1 / t)).to(torch.bfloat16) for t in near]
        shows = torch.zeros_like(acc, dtype=torch.bool)
        for out in outs[1:]:
            shows |= out != outs[0]
        picked = shows.nonzero().flatten()[:64]
        if picked.numel() == 0:
            continue
        picked = picked.repeat(64)[:64]
        v = torch.zeros(keys, 64, dtype=torch.bfloat16)
        v[top], v[second] = c1[picked].to(torch.bfloat16), c2[picked].to(torch.bfloat16)
        expected = F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None], scale=0.125)[0, 0]
        blocks = -(-keys // 16)
        k_cache, v_cache = (torch.zeros(blocks * 16, 1, 64, dtype=torch.bfloat16) for _ in range(2))
        k_cache[:keys, 0], v_cache[:keys, 0] = k, v
        tables = torch.arange(blocks, dtype=torch.int32)[None]
        rows = attention.kernel_rows(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([keys], dtype=torch.int32),
                                     tables)
        got = torch.empty(1, 1, 64, dtype=torch.bfloat16)
        kernel.paged_decode(got, q.view(1, 1, 64), k_cache.view(blocks, 16, 1, 64), v_cache.view(blocks, 16, 1, 64),
                            rows.tables, rows.lens, rows.tokens, 0.125, 0, 0.0, None, None, 0, rows.ends, lanes,
                            rows.qrows)
        assert torch.equal(got[0], expected), keys
        checked += 1
    assert checked >= 150
