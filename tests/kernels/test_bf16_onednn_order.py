"""bfloat16 products bit for bit `F.linear`'s (oneDNN's GEMM) on SmolLM2-135M's shapes, at the row
counts a step brings, through each route ops/linear.py takes: the AVX512-BF16 kernel on its packed
weight, the codes kernel for a few rows (both sum in oneDNN's order, pagedserve_kernels/cpu/simd.h), and oneDNN's
own GEMM on a weight packed once."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import linear, quantized
from tests.helpers import q4_1_form, q8_0_form

# (outputs, inputs) of SmolLM2-135M's products: q and o, k and v, gate and up, down, the output layer
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = [1, 2, 4, 5, 16, 64, 200]
VOCAB_ROWS = [1, 4, 5, 16]   # the output layer: a step's last rows only


def _layer(kernel, outputs: int, inputs: int, seed: int):
    """A bfloat16 weight rounded from GGUF codes (Q8_0 for the output layer, as the model's file has it,
    Q4_1 for the rest), routed as the data plane routes it."""
    form = q8_0_form if outputs == 49152 else q4_1_form
    wide = form(torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(seed)) * 0.05)
    narrow = wide.to(torch.bfloat16)
    return narrow, linear.RoutedLinear(narrow, None, kernel, packed=True, codes=quantized.find_codes(wide))


@pytest.fixture(scope="module")
def dot_route(kernel):
    """Skips where the kernels' order is not oneDNN's: the bit-for-bit claim holds where they are the
    route (AVX512-BF16 and no AMX: oneDNN's GEMM there is its AVX512-BF16 brgemm)."""
    if not kernel.has_bf16_dot():
        pytest.skip("no AVX512-BF16 on this CPU: bfloat16 layers take oneDNN's GEMM (tested below) or, on AVX2 alone, bf16_dots_linear")
    if not linear.bf16_dot_kernel(kernel):
        pytest.skip("AMX tiles on this CPU: oneDNN's AMX GEMM is the route there (tested below)")
    return kernel


@pytest.mark.parametrize("outputs,inputs", SHAPES)
def test_every_route_gives_f_linears_bits(dot_route, outputs, inputs):
    weight, routed = _layer(dot_route, outputs, inputs, seed=outputs + inputs)
    assert routed.codes is not None and routed.dot is not None
    gen = torch.Generator().manual_seed(inputs)
    with torch.no_grad():
        for rows in VOCAB_ROWS if outputs == 49152 else ROWS:
            x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
            want = F.linear(x, weight)
            assert torch.equal(dot_route.bf16_linear(x, routed.dot), want), rows
            if rows <= linear.BF16_DOT_CODES_MAX_ROWS:
                assert torch.equal(routed.codes.linear(dot_route, x), want), rows
            assert torch.equal(routed(x), want), rows


def _cancelling(inputs: int, rows: int = 33, outputs: int = 64):
    """x, W (Q8_0 codes rounded to bfloat16, and those codes) whose second half of inputs undoes the
    first but for small differences: each result is small beside its partial sums, so another order of
    the float32 sums shows in its bfloat16 bits (the kernels' earlier order, front to back in one
    chunk, differed from oneDNN's in 1-10% of these outputs)."""
    gen = torch.Generator().manual_seed(inputs)
    half = inputs // 64 * 32   # whole blocks of 32: the negated half keeps the codes' form
    wide = q8_0_form(torch.randn(outputs, inputs, generator=gen))
    wide[:, half:2 * half] = -wide[:, :half] + 0.0   # no negative zeros: codes give them back as zeros
    x = torch.randn(rows, inputs, generator=gen)
    x[:, half:2 * half] = x[:, :half] + 1e-3 * torch.randn(rows, half, generator=gen)
    return x.to(torch.bfloat16), wide.to(torch.bfloat16), quantized.find_codes(wide)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_order_holds_whatever_the_threads_and_the_chunks(dot_route, threads):
    # oneDNN sums K in chunks of 512 inputs, or of 1024 past 1024: one chunk, chunks and a short tail;
    # its order does not depend on the threads, nor does the kernels'
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for inputs in (96, 576, 1024, 1088, 1536, 3136):
            x, weight, codes = _cancelling(inputs)
            want = F.linear(x, weight)
            assert torch.equal(dot_route.bf16_linear(x, dot_route.bf16_pack(weight)), want), inputs
            assert codes is not None and codes.rounds_to(dot_route, weight)
            for rows in (1, linear.BF16_DOT_CODES_MAX_ROWS):
                assert torch.equal(codes.linear(dot_route, x[:rows].contiguous()), want[:rows]), (inputs, rows)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("inputs", [576, 1088, 1536, 3136])
def test_rows_of_one_row_calls_sum_as_such_a_call(dot_route, inputs):
    # oneDNN sums a call of one row in chunks of 512 inputs whatever K (of more rows, 1024 past 1024): the
    # rows that `one_row` marks get F.linear's bits of that row alone, the others those of the whole call,
    # through every route and in any mix
    x, weight, codes = _cancelling(inputs, rows=9)
    one_row = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    together = F.linear(x, weight)
    want = torch.stack([F.linear(x[r:r + 1], weight)[0] if one_row[r] else together[r] for r in range(9)])
    if inputs > 1024:   # else both kinds of call sum alike, and the flags change nothing
        assert not torch.equal(want, together)
    assert torch.equal(dot_route.bf16_linear(x, dot_route.bf16_pack(weight), one_row), want)
    assert torch.equal(dot_route.bf16_linear(x, dot_route.bf16_pack(weight)), together)
    paired = codes.paired_order()
    for rows in range(1, linear.BF16_DOT_CODES_MAX_ROWS + 1):
        few, flags = x[:rows].contiguous(), one_row[:rows].contiguous()
        assert torch.equal(codes.product(dot_route)(few, codes.codes, codes.scales, codes.mins, flags), want[:rows])
        assert torch.equal(paired.product(dot_route)(few, paired.codes, paired.scales, paired.mins, flags),
                           want[:rows])
    routed = linear.RoutedLinear(weight, None, dot_route, packed=True, codes=codes)
    with torch.no_grad():
        for rows in (1, 3, 9):
            assert torch.equal(routed(x[:rows], one_row[:rows].contiguous()), want[:rows]), rows


def test_one_row_flags_are_checked(kernel):
    if not kernel.has_bf16_dot():
        pytest.skip("no AVX512-BF16 in this build")
    x, packed = torch.zeros(3, 64, dtype=torch.bfloat16), kernel.bf16_pack(torch.zeros(16, 64, dtype=torch.bfloat16))
    for bad in (torch.ones(2, dtype=torch.bool), torch.ones(3, dtype=torch.int32), torch.ones(6, dtype=torch.bool)[::2]):
        with pytest.raises(RuntimeError, match="one_row must be a contiguous bool"):
            kernel.bf16_linear(x, packed, bad)


def test_onednns_packed_gemm_gives_f_linears_bits():
    # the route where the kernels are not (AMX, or AVX-512 without its BF16 dot product): oneDNN on a
    # weight reordered once; AVX2-only CPUs take tests/kernels/test_bf16_dots_linear.py's route instead
    if not linear.has_packed_bf16_gemm():
        pytest.skip("oneDNN has no packed bfloat16 GEMM in this torch or for this CPU")
    for outputs, inputs in SHAPES[:4]:
        gen = torch.Generator().manual_seed(outputs * inputs)
        weight = torch.randn(outputs, inputs, generator=gen).to(torch.bfloat16)
        routed = linear.RoutedLinear(weight, None, None, packed=True)
        assert routed.packed is not None
        with torch.no_grad():
            for rows in (1, 5, 64):
                x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
                assert torch.equal(routed(x), F.linear(x, weight)), (outputs, inputs, rows)

