"""ops/quantized.py and pagedserve_kernels/cpu/coded_linear.cpp: float32 weights that are exactly GGUF Q4_1 or
Q8_0 codes expanded are found, give back every bit, and the kernel reading the codes computes x W^T."""
import sys

import pytest
import torch

from ops import linear, quantized
from tests.helpers import q4_1_form, q8_0_form

FORMS = {"q4_1": q4_1_form, "q8_0": q8_0_form}


def _weight(kind, n, k, seed=0):
    return FORMS[kind](torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("kind", FORMS)
def test_codes_give_back_every_weight_bit_for_bit(kernel, kind):
    weight = _weight(kind, 80, 96)
    weight[3, 32:64] = 0.25 if kind == "q4_1" else 0.0   # a block of one value: scale 0
    weight[17] = weight[17].flip(0)                    # codes are per row: any row order
    codes = quantized.find_codes(weight)
    assert codes is not None and codes.kind == kind
    assert codes.codes.shape == ((5, 48, 16) if kind == "q4_1" else (5, 96, 16))
    assert codes.scales.shape == (5, 3, 16)
    assert codes.nbytes * (3.7 if kind == "q8_0" else 6.3) < weight.numel() * 4   # float16 scales: 5 and 8.5 bits a weight
    assert codes.scales.dtype == torch.float16 and (codes.mins is None or codes.mins.dtype == torch.float16)
    expanded = kernel.coded_expand(codes.codes, codes.scales, codes.mins)
    assert torch.equal(_bits(expanded), _bits(weight))


@pytest.mark.parametrize("case", ["random floats", "one weight one ulp off", "one ulp off past the first rows",
                                  "a negative zero", "rows not 16s",
                                  "inputs not 32s", "bfloat16", "a NaN"])
@pytest.mark.parametrize("kind", FORMS)
def test_weights_not_exactly_of_that_form_are_left_alone(case, kind):
    weight = _weight(kind, 32, 64)
    if case == "random floats":
        weight = torch.randn(32, 64)
    elif case == "one weight one ulp off":
        weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(10.0))
    elif case == "one ulp off past the first rows":   # the first 16 rows are searched first
        weight[29, 3] = torch.nextafter(weight[29, 3], torch.tensor(-10.0))
    elif case == "a negative zero":   # equal to 0.0 as a number, not as bits
        weight[0, 0:32] = 0.0
        weight[0, 7] = -0.0
    elif case == "rows not 16s":
        weight = _weight(kind, 24, 64)
    elif case == "inputs not 32s":
        weight = weight[:, :48].contiguous()
    elif case == "bfloat16":
        weight = weight.to(torch.bfloat16)
    else:
        weight[1, 1] = float("nan")
    assert quantized.find_codes(weight) is None


@pytest.mark.parametrize("kind", FORMS)
@pytest.mark.parametrize("n", [16, 32, 48, 80, 176])   # panels of 1, 2 and 3 groups, and mixes
def test_kernel_computes_x_times_w_transposed(kernel, kind, n):
    weight = _weight(kind, n, 160, seed=n)
    codes = quantized.find_codes(weight)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 7, 8, 9, 16, 17, 70):     # every tile height and a tail after full tiles
        x = torch.randn(rows, 160, generator=gen)
        want = (x.double() @ weight.double().T).float()
        torch.testing.assert_close(codes.linear(kernel, x), want, atol=1e-4, rtol=1e-5)


def _fma_chain(x, weight):
    """Each output as one FMA chain over k = 0..K-1 in order, in float32: a product of two float32 values is
    exact in float64 and the sum is rounded once to float32 (a double rounding could differ from the FMA's
    single one only where the float64 sum itself rounds: not for these magnitudes)."""
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = (x[:, k:k + 1].double() * weight[:, k].double() + acc.double()).float()
    return acc


@pytest.mark.parametrize("kind", FORMS)
def test_every_output_is_the_fma_chain_over_k_in_order(kernel, kind):
    # the order every path and every instruction set sums in (the in-register path, the panel's tiles,
    # AVX-512 or AVX2), so a machine's outputs are another's bit for bit
    weight = _weight(kind, 96, 256, seed=4)
    codes = quantized.find_codes(weight)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(5))
    want = _fma_chain(x, weight)
    assert not torch.equal(want, (x.double() @ weight.double().T).float())   # the order shows in the bits
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24):
        assert torch.equal(_bits(codes.linear(kernel, x[:rows].contiguous())), _bits(want[:rows])), rows


@pytest.mark.parametrize("kind", FORMS)
# 400, 448, 480: 25, 28 and 30 groups, so the in-register path takes several at a time, and a thread's
# share of them (on two threads 13 and 12, 14, 15) leaves 1, 2 or 3 groups after its full sets
@pytest.mark.parametrize("n", [96, 400, 448, 480])
def test_a_rows_result_does_not_depend_on_the_batch_it_comes_in(kernel, kind, n):
    codes = quantized.find_codes(_weight(kind, n, 128, seed=3))
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2))
    together = codes.linear(kernel, x)   # 40 rows: the panel's tiles
    for i in (0, 7, 8, 17):
        for few in range(1, 17):   # the in-register path's row counts, against the batch's tiles
            assert torch.equal(codes.linear(kernel, x[i:i + few].contiguous()), together[i:i + few]), (i, few)
    for dtype in (torch.bfloat16,):
        narrow = x.to(dtype)
        batch = codes.linear(kernel, narrow)
        assert torch.equal(codes.linear(kernel, narrow[3:4].contiguous())[0], batch[3])


def test_kernel_refuses_what_does_not_fit(kernel):
    q4, q8 = quantized.find_codes(_weight("q4_1", 32, 64)), quantized.find_codes(_weight("q8_0", 32, 64))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kernel.coded_linear(torch.randn(2, 80), q4.codes, q4.scales, q4.mins)
    with pytest.raises(RuntimeError, match="Q4_1 codes"):     # x's K is not the codes'
        kernel.coded_linear(torch.randn(2, 96), q4.codes, q4.scales, q4.mins)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.coded_linear(torch.randn(2, 64, dtype=torch.float64), q4.codes, q4.scales, q4.mins)
    with pytest.raises(RuntimeError, match="Q4_1 codes"):     # Q8_0 codes with a minimum
        kernel.coded_linear(torch.randn(2, 64), q8.codes, q8.scales, q8.scales)
    with pytest.raises(RuntimeError, match="Q8_0 codes"):     # Q4_1 codes without one
        kernel.coded_linear(torch.randn(2, 64), q4.codes, q4.scales, None)
    with pytest.raises(RuntimeError, match=r"\[N / 16, K / 32, 16\] float16"):   # scales of another type
        kernel.coded_linear(torch.randn(2, 64), q4.codes, q4.scales.float(), q4.mins.float())


def test_routed_linear_reads_codes_at_every_row_count_and_packs_nothing(kernel, monkeypatch):
    weight = _weight("q4_1", 64, 96, seed=5)
    routed = linear.RoutedLinear(weight, None, kernel, packed=True)
    if not kernel.has_coded_simd():
        # the scalar loop (no AVX-512) is slower than MKL over the float32 weight: the layer keeps that route
        assert routed.codes is None and (routed.packed is not None or not linear.has_packed_gemm())
        return
    assert routed.codes is not None and routed.packed is None     # no second float32 copy for MKL
    calls = []
    real = kernel.coded_linear
    monkeypatch.setattr(kernel, "coded_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    with torch.no_grad():   # training keeps torch's F.linear
        for rows in (1, 9, 300):
            x = torch.randn(1, rows, 96)
            torch.testing.assert_close(routed(x), torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert calls == [1, 9, 300]
    assert linear.RoutedLinear(weight, None, kernel, packed=True, codes=False).codes is None
    assert linear.RoutedLinear(weight, torch.zeros(64), kernel, packed=False).codes is None   # it adds no bias


@pytest.mark.parametrize("kind", FORMS)
@pytest.mark.parametrize("n", [80, 400, 448])
def test_bfloat16_rows_multiply_the_bfloat16_weights(kernel, kind, n):
    # a bfloat16 model is its float32 GGUF weights rounded to bfloat16: the codes found on the float32
    # weight give the bfloat16 one back bit for bit, and the kernel's bfloat16 product is oneDNN's
    # (exact products, float32 sums) up to the order of the sums, rounded once
    wide = _weight(kind, n, 160, seed=7)
    codes = quantized.find_codes(wide)
    narrow = wide.to(torch.bfloat16)
    assert codes.rounds_to(kernel, narrow)
    assert not codes.rounds_to(kernel, (narrow.float() * 1.01).to(torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)
        got = codes.linear(kernel, x)
        assert got.dtype == torch.bfloat16
        want = (x.double() @ narrow.double().T).to(torch.bfloat16)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=2 ** -7)
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, narrow).float(), atol=1e-3, rtol=2 ** -7)
        if kernel.has_bf16_dot() and rows <= 4:
            # a few rows sum with the AVX512-BF16 dot product in the bfloat16 GEMM kernel's order: its bits,
            # so a row's result does not depend on which of the two routes its step took; where oneDNN's GEMM
            # takes AMX tiles, in that GEMM's order (`F.linear`'s bits)
            assert torch.equal(got, torch.nn.functional.linear(x, narrow) if linear.onednn_tile_order(kernel)
                               else kernel.bf16_linear(x, kernel.bf16_pack(narrow)))


def test_bfloat16_few_rows_sum_in_onednns_amx_order_where_it_has_one(kernel):
    # where oneDNN's bfloat16 GEMM takes AMX tiles (the start-up check: linear.onednn_tile_order), the codes' few
    # rows sum in its order: `F.linear`'s bits at 1-4 rows; in the AVX512-BF16 order some outputs are not
    if not linear.onednn_tile_order(kernel):
        pytest.skip("oneDNN's bfloat16 GEMM does not sum in AMX tiles' order on this CPU")
    wide = _weight("q8_0", 16384, 576, seed=9)
    codes, narrow = quantized.find_codes(wide).paired_order(), wide.to(torch.bfloat16)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    try:
        for tiles in (True, False):
            kernel.set_bf16_tile_order(tiles)
            equal = [torch.equal(codes.linear(kernel, x[:rows]), torch.nn.functional.linear(x[:rows], narrow))
                     for rows in range(1, 5)]
            assert all(equal) if tiles else not all(equal)
    finally:
        kernel.set_bf16_tile_order(True)


def test_bfloat16_routes_codes_for_few_rows_and_a_gemm_for_many(kernel, monkeypatch):
    wide = _weight("q4_1", 64, 96, seed=5)
    narrow = wide.to(torch.bfloat16)
    routed = linear.RoutedLinear(narrow, None, kernel, packed=True, codes=quantized.find_codes(wide))
    if not kernel.has_coded_simd():
        # no AVX-512: the codes' scalar loop is not taken (AVX2 takes bf16_dots_linear where K allows)
        assert routed.codes is None
        return
    assert routed.codes is not None
    # many rows: the AVX512-BF16 kernel where it is the route, the AMX tiles' where they are, else oneDNN's GEMM
    assert (routed.dot is not None) == linear.bf16_dot_kernel(kernel)
    assert (routed.tiles is not None) == linear.amx_tiles(kernel)
    many = routed.dot is not None or routed.tiles is not None or routed.packed is not None
    assert many or not linear.has_packed_bf16_gemm()
    calls = []
    for name in ("coded_linear", "coded_pairs_linear"):   # the second where the codes are in pair order
        real = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda x, *a, real=real: calls.append(x.shape[0]) or real(x, *a))
    with torch.no_grad():
        cap = routed.codes_max_rows
        assert cap == (linear.BF16_DOT_CODES_MAX_ROWS if routed.dot is not None else
                       linear.BF16_CODES_MAX_ROWS if many else sys.maxsize)
        # where the codes feed AMX tiles they do so for their Q4_1 codes whose expansion is the tiles' weight
        assert routed.tile_codes == (routed.tiles is not None and kernel.has_amx_codes_linear())
        for rows in (1, 300) if cap == sys.maxsize else (1, cap, cap + 1, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            torch.testing.assert_close(routed(x).float(), torch.nn.functional.linear(x, narrow).float(),
                                       atol=1e-3, rtol=2 ** -7)
    assert calls == [1, cap] or not many
    # codes of another weight are not taken
    other = quantized.find_codes(_weight("q4_1", 64, 96, seed=6))
    assert linear.RoutedLinear(narrow, None, kernel, packed=True, codes=other).codes is None


@pytest.mark.parametrize("kind", FORMS)
@pytest.mark.parametrize("n,k", [(48, 160), (112, 2112)])   # 3 and 7 groups; one chunk of the sums, and three
def test_codes_in_pair_order_give_the_same_bits(kernel, kind, n, k):
    if not kernel.has_bf16_dot():
        pytest.skip("no AVX512-BF16 in this build: the pair order is not used")
    codes = quantized.find_codes(_weight(kind, n, k, seed=11))
    paired = codes.paired_order()
    assert paired.paired and not codes.paired and paired.paired_order() is paired
    assert paired.codes.shape == codes.codes.shape and not torch.equal(paired.codes, codes.codes)
    back = paired.plain_order()
    assert not back.paired and torch.equal(back.codes, codes.codes) and codes.plain_order() is codes
    gen = torch.Generator().manual_seed(5)
    for rows in range(1, 9):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        assert torch.equal(paired.linear(kernel, x), codes.linear(kernel, x)), rows
    with pytest.raises(RuntimeError, match="1 <= M <= 8"):
        paired.linear(kernel, torch.randn(9, k).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        paired.linear(kernel, torch.randn(1, k))
    with pytest.raises(ValueError, match="plain layout"):
        paired.rounds_to(kernel, torch.zeros(n, k, dtype=torch.bfloat16))
    # the data plane's routing keeps only the pair order where the codes serve a few rows alone
    narrow = _weight(kind, n, k, seed=11).to(torch.bfloat16)
    routed = linear.RoutedLinear(narrow, None, kernel, packed=True, codes=codes)
    assert routed.codes.paired == (routed.dot is not None or routed.packed is not None or routed.tiles is not None)
