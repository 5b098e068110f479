"""The bfloat16 product on AMX tiles (pagedserve_kernels/cpu/amx_linear.cpp) and the route that gives each row
transformers' bits: a generated token those of its call alone, a prompt's rows those of the prompt's call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import linear
from tests.helpers import cpu_flags


def _amx(kernel) -> bool:
    return kernel.has_amx_linear()


def test_the_build_has_the_tiles_where_the_cpu_has_them(kernel):
    # the kernels are built for the CPU they run on (-march=native); Linux lends the tiles on asking
    assert kernel.has_amx_linear() == ({"amx_tile", "amx_bf16", "avx512f"} <= cpu_flags())
    if not _amx(kernel):
        w = kernel.bf16_pack(torch.zeros(16, 32, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="no AMX tiles"):
            kernel.amx_linear(torch.zeros(1, 32, dtype=torch.bfloat16), w)
        assert linear.RoutedLinear(torch.zeros(64, 96, dtype=torch.bfloat16), None, kernel, packed=True).tiles is None


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (576, 208), (64, 16)])   # 208: an odd group of 16 outputs
def test_every_row_has_the_bits_of_its_call_alone_at_every_row_count(kernel, shape):
    if not _amx(kernel):
        pytest.skip("no AMX tiles on this CPU (test_the_build_has_the_tiles_where_the_cpu_has_them checks that)")
    inputs, outputs = shape
    gen = torch.Generator().manual_seed(inputs + outputs)
    w = (torch.randn(outputs, inputs, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(70, inputs, generator=gen).to(torch.bfloat16)
    alone = torch.cat([F.linear(x[r:r + 1], w) for r in range(70)])   # oneDNN's call of one row: transformers' decode
    tiles = kernel.bf16_pack(w)
    for rows in (1, 2, 15, 16, 17, 32, 33, 48, 70):
        got = kernel.amx_linear(x[:rows], tiles)
        assert got.shape == (rows, outputs) and torch.equal(got.view(torch.int16), alone[:rows].view(torch.int16))
    # a chunk of every input, or of 32 (one tile step each), is the same order
    assert torch.equal(kernel.amx_linear(x, tiles, inputs), alone)
    assert torch.equal(kernel.amx_linear(x, tiles, 32), alone)


def test_chunks_per_row_and_a_slice_of_outputs(kernel):
    if not _amx(kernel):
        pytest.skip("no AMX tiles on this CPU (test_the_build_has_the_tiles_where_the_cpu_has_them checks that)")
    gen = torch.Generator().manual_seed(5)
    # the second half of each row's products nearly cancels the first: other orders of the sums give other bits
    # often (on plain random rows about one output in 8,000)
    half = torch.randn(40, 288, generator=gen)
    x = torch.cat([half, half], 1).to(torch.bfloat16)
    w = torch.randn(96, 288, generator=gen)
    w = torch.cat([w, torch.randn(96, 288, generator=gen) / 128 - w], 1).to(torch.bfloat16)
    tiles = kernel.bf16_pack(w)
    row_chunks = torch.zeros(40, dtype=torch.int32)
    row_chunks[5:30], row_chunks[30:33] = 288, 192
    y = torch.full((40, 128), 7.0, dtype=torch.bfloat16)
    kernel.amx_linear_out(x, tiles[1:4], y[:, 16:64], 0, row_chunks)   # outputs 16..63 into columns 16..63
    expected = torch.cat([kernel.amx_linear(x[:5], tiles), kernel.amx_linear(x[5:30], tiles, 288),
                          kernel.amx_linear(x[30:33], tiles, 192), kernel.amx_linear(x[33:], tiles)])
    assert torch.equal(y[:, 16:64], expected[:, 16:64])
    assert bool((y[:, :16] == 7).all()) and bool((y[:, 64:] == 7).all())   # nothing written beside the slice
    # the chunks' sums are other sums: some outputs differ from the one accumulator's
    assert not torch.equal(expected[5:30], kernel.amx_linear(x[5:30], tiles))


def test_the_product_refuses_what_it_cannot_compute(kernel):
    if not _amx(kernel):
        pytest.skip("no AMX tiles on this CPU (test_the_build_has_the_tiles_where_the_cpu_has_them checks that)")
    tiles = kernel.bf16_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="K matching x"):
        kernel.amx_linear(torch.zeros(3, 96, dtype=torch.bfloat16), tiles)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kernel.amx_linear(torch.zeros(3, 48, dtype=torch.bfloat16), kernel.bf16_pack(torch.zeros(16, 48).bfloat16()))
    with pytest.raises(RuntimeError, match="chunk 0"):
        kernel.amx_linear(x, tiles, 48)
    with pytest.raises(RuntimeError, match="row_chunks int32"):
        kernel.amx_linear_out(x, tiles, torch.empty(3, 32, dtype=torch.bfloat16), 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="out \\[M, N\\]"):
        kernel.amx_linear_out(x, tiles, torch.empty(3, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [33, 40, 90, 200])
def test_the_chunk_found_for_a_call_gives_its_bits_on_other_rows(kernel, rows):
    # onednn_chunk finds the order of oneDNN's call of `rows` rows on rows of its own; the order is the call's,
    # so the tiles in that chunk give F.linear's bits on any rows
    if not _amx(kernel) or not linear.amx_tiles(kernel):
        pytest.skip("no AMX tiles here, or oneDNN sums its few rows in another order than theirs")
    gen = torch.Generator().manual_seed(rows)
    for outputs, inputs in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        chunk = linear.onednn_chunk(kernel, rows, outputs, inputs)
        if chunk is None:   # (an order of no chunk: such calls take F.linear itself)
            continue
        assert inputs % chunk == 0 and chunk % 32 == 0
        w = (torch.randn(outputs, inputs, generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
        assert torch.equal(kernel.amx_linear(x, kernel.bf16_pack(w), chunk), F.linear(x, w))


def test_a_stacked_weights_prompt_rows_take_each_parts_call_and_the_rest_their_own(kernel):
    if not _amx(kernel) or not linear.amx_tiles(kernel):
        pytest.skip("no AMX tiles here, or oneDNN sums its few rows in another order than theirs")
    gen = torch.Generator().manual_seed(11)
    parts = (576, 192, 192)   # a layer's q, k and v
    w = (torch.randn(sum(parts), 576, generator=gen) * 0.05).to(torch.bfloat16)
    routed = linear.RoutedLinear(w, None, kernel, packed=True, codes=None, parts=parts)
    assert routed.tiles is not None and routed.packed is None   # one copy of the weight beside it, not two
    x = torch.randn(120, 576, generator=gen).to(torch.bfloat16)
    # rows 0..3 and 44..49 generated tokens; 4..43 a whole prompt of 40; 50..119 rows 30..99 of a prompt of 100
    own = linear.OwnCalls([(4, 44, 40, 0), (50, 120, 100, 30)], 120)
    with torch.no_grad():
        got = routed(x, None, own)
        prompt = torch.zeros(100, 576, dtype=torch.bfloat16)
        prompt[30:] = x[50:]
        for lo, hi in ((0, 576), (576, 768), (768, 960)):
            assert torch.equal(got[4:44, lo:hi], F.linear(x[4:44], w[lo:hi]))
            assert torch.equal(got[50:, lo:hi], F.linear(prompt, w[lo:hi])[30:])
        for r in (*range(4), *range(44, 50)):
            assert torch.equal(got[r:r + 1], F.linear(x[r:r + 1], w))
        # without prompts, every row its own call's bits, in one call of the tiles
        assert torch.equal(routed(x[:4]), F.linear(x[:4], w))
    with pytest.raises(ValueError, match="do not add up"):
        linear.RoutedLinear(w, None, kernel, packed=True, codes=None, parts=(576, 192))


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 208)])   # 208: an odd group of 16 outputs
def test_the_tiles_from_q4_1_codes_are_the_bfloat16_weights_and_give_their_bits(kernel, shape):
    # amx_codes_linear expands a bfloat16 weight's Q4_1 codes (pair order) into the tiles as it goes: its tiles
    # are bf16_pack's of the weight the codes round to, and every row count's outputs amx_linear's on those
    if not kernel.has_amx_codes_linear():
        assert not (kernel.has_amx_linear() and "avx512_bf16" in cpu_flags())
        pytest.skip("no AMX tiles and AVX512-BF16 on this CPU")
    from ops import quantized
    from tests.helpers import q4_1_form
    inputs, outputs = shape
    gen = torch.Generator().manual_seed(inputs + 3 * outputs)
    wide = q4_1_form(torch.randn(outputs, inputs, generator=gen))
    codes, narrow = quantized.find_codes(wide).paired_order(), wide.to(torch.bfloat16)
    tiles = kernel.bf16_pack(narrow)
    assert torch.equal(kernel.amx_codes_expand(codes.codes, codes.scales, codes.mins).view(torch.int16),
                       tiles.view(torch.int16))
    x = torch.randn(70, inputs, generator=gen).to(torch.bfloat16)
    for rows in (1, 2, 5, 16, 17, 32, 33, 48, 70):   # up to 32 rows one pass, expanded as it goes; more from a buffer
        got = kernel.amx_codes_linear(x[:rows], codes.codes, codes.scales, codes.mins)
        assert got.shape == (rows, outputs)
        assert torch.equal(got.view(torch.int16), kernel.amx_linear(x[:rows], tiles).view(torch.int16))
    with pytest.raises(RuntimeError, match="pair order"):
        kernel.amx_codes_linear(x, codes.codes[:, :-1], codes.scales, codes.mins)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_codes_few_rows_and_the_codes_tiles_agree(kernel, rows):
    # a step's product takes the codes' few-row kernel (coded_pairs_linear, in the tiles' order) or the codes' tiles
    # by its row count, and a row's bits must not depend on which: equal at 1-4 rows whatever the rows' flags
    if not kernel.has_amx_codes_linear() or not linear.onednn_tile_order(kernel):
        pytest.skip("no AMX tiles and AVX512-BF16 on this CPU, or oneDNN does not sum in the tiles' order")
    from ops import quantized
    from tests.helpers import q4_1_form
    gen = torch.Generator().manual_seed(rows)
    for inputs, outputs in ((576, 960), (1536, 576)):
        codes = quantized.find_codes(q4_1_form(torch.randn(outputs, inputs, generator=gen))).paired_order()
        x = (torch.randn(rows, inputs, generator=gen) * 3).to(torch.bfloat16)
        tiles = kernel.amx_codes_linear(x, codes.codes, codes.scales, codes.mins)
        for flags in (None, torch.ones(rows, dtype=torch.bool), torch.arange(rows) % 2 == 0):
            few = kernel.coded_pairs_linear(x, codes.codes, codes.scales, codes.mins, flags)
            assert torch.equal(few.view(torch.int16), tiles.view(torch.int16))
