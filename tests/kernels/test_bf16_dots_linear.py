"""bfloat16 products in the order of torch's own GEMM (pagedserve_kernels/cpu/bf16_dots_linear.cpp), the
route of bfloat16 layers where oneDNN has no bfloat16 GEMM for the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import linear, quantized
from tests.helpers import q4_1_form, q8_0_form


def _in_torchs_order(x: torch.Tensor, w: torch.Tensor, lanes_in_turn: bool = False) -> torch.Tensor:
    """x W^T summed as the kernel's comment says, in float32 tensor operations (each product of two
    bfloat16 values is exact in float32): every 64th input into one of 8 x 8 running sums, the sums
    halved as a tree, then the lanes; `lanes_in_turn`: the lanes added one after another instead."""
    M, K = x.shape
    N = w.shape[0]
    xf, wf = x.float().view(M, 1, K // 64, 8, 8), w.float().view(1, N, K // 64, 8, 8)
    sums = torch.zeros(M, N, 8, 8)
    for i in range(K // 64):
        sums = sums + xf[:, :, i] * wf[:, :, i]
    sums = sums[:, :, :4] + sums[:, :, 4:]
    sums = sums[:, :, :2] + sums[:, :, 2:]
    lanes = sums[:, :, 0] + sums[:, :, 1]
    if lanes_in_turn:
        out = lanes[..., 0]
        for lane in range(1, 8):
            out = out + lanes[..., lane]
        return out.to(torch.bfloat16)
    lanes = lanes[..., :4] + lanes[..., 4:]
    lanes = lanes[..., :2] + lanes[..., 2:]
    return (lanes[..., 0] + lanes[..., 1]).to(torch.bfloat16)


def _cancelling(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """bfloat16 values of many magnitudes whose sums cancel: orders of adding them give other float32 sums"""
    scale = torch.exp2(torch.randint(-6, 7, (rows, cols), generator=gen).float())
    return (torch.randn(rows, cols, generator=gen) * scale).to(torch.bfloat16)


def _need_kernel_path(kernel):
    if not kernel.vectorized():
        with pytest.raises(RuntimeError, match="no AVX2"):
            kernel.bf16_dots_linear(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16))
        pytest.skip("this build has no AVX2/FMA path")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64])   # one, walked, tiles
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (64, 5), (128, 7)])   # (K, N): tiles and remainders
def test_the_kernel_sums_in_the_order_its_comment_gives(kernel, rows, shape):
    _need_kernel_path(kernel)
    K, N = shape
    gen = torch.Generator().manual_seed(rows * 1000 + K + N)
    x, w = _cancelling(rows, K, gen), _cancelling(N, K, gen)
    got = kernel.bf16_dots_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
    assert torch.equal(got, _in_torchs_order(x, w))
    # each row alone gives its bits in the batch
    for r in {0, rows - 1}:
        assert torch.equal(kernel.bf16_dots_linear(x[r:r + 1].contiguous(), w), got[r:r + 1])


def test_the_inputs_tell_the_orders_apart(kernel):
    # the check above could not pass by luck: on its inputs the lanes added in turn, or one float32
    # sum front to back, give other bits for some outputs
    gen = torch.Generator().manual_seed(5)
    x, w = _cancelling(64, 1536, gen), _cancelling(576, 1536, gen)
    ours = _in_torchs_order(x, w)
    assert (ours != _in_torchs_order(x, w, lanes_in_turn=True)).sum() > 0
    assert (ours != (x.float() @ w.float().T).to(torch.bfloat16)).sum() > 0


def test_where_torch_uses_its_own_gemm_the_kernel_is_f_linear_and_the_layers_route(kernel):
    w = _cancelling(576, 1536, torch.Generator().manual_seed(2))
    routed = linear.RoutedLinear(w, None, kernel, packed=True)
    if linear.has_packed_bf16_gemm() or not kernel.vectorized():
        # oneDNN's GEMM is F.linear's route here (or no kernel path): the layers keep their other routes
        assert not linear.bf16_dots_kernel(kernel) and not routed.dots
        return
    assert linear.bf16_dots_kernel(kernel) and routed.dots and routed.codes is None and routed.packed is None
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows in (1, 2, 5, 16, 40):
            x = _cancelling(rows, 1536, gen)
            expected = F.linear(x, w)
            assert torch.equal(kernel.bf16_dots_linear(x, w), expected)
            assert torch.equal(routed(x), expected)
    # shapes it does not take keep torch's op: K not a multiple of 64, a bias
    assert not linear.RoutedLinear(_cancelling(8, 96, gen), None, kernel, packed=True).dots
    assert not linear.RoutedLinear(w, torch.zeros(576, dtype=torch.bfloat16), kernel, packed=True).dots


def test_bad_inputs_are_refused(kernel):
    _need_kernel_path(kernel)
    w = torch.zeros(8, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.bf16_dots_linear(torch.zeros(2, 96, dtype=torch.bfloat16), torch.zeros(8, 96, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K matching x"):
        kernel.bf16_dots_linear(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        kernel.bf16_dots_linear(torch.zeros(2, 128), w)
    assert kernel.bf16_dots_linear(torch.zeros(0, 128, dtype=torch.bfloat16), w).shape == (0, 8)


def _coded_bf16(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, quantized.Codes]:
    """A bfloat16 weight [n, k] that is GGUF codes (`kind`) expanded and rounded, with its codes; its blocks
    span magnitudes (so that many weights round), and a row or two land on bfloat16's ties (a float32 value
    whose 16 bits that rounding drops are 0x8000): Q4_1 with scale 2^-8 and minimum 1, where the odd codes
    give 1 + c 2^-8; Q8_0 with scale 1 + 2^-8, where codes +-2^j give 2^j + 2^(j - 8)."""
    wide = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 4, (n, k // 32, 1), generator=gen)
                                                        .float()).repeat_interleave(32, 1).view(n, k)
    if kind == "q4_1":
        wide = q4_1_form(wide)
        ties = torch.arange(16).float().repeat(k // 16) * 2.0 ** -8 + 1.0   # codes 0..15 over every block
        wide[1] = ties
        wide[2] = -ties.flip(0)
    else:
        wide = q8_0_form(wide)
        codes = torch.tensor([1, 2, 4, 8, 16, 32, 64, 3, -1, -2, -4, -8, -16, -32, -64, -5.0]).repeat(k // 16)
        codes[::32] = 127   # every block's largest magnitude: its scale is found from it
        wide[1] = codes * (1 + 2.0 ** -8)
    assert ((wide[1:3].view(torch.int32) & 0xFFFF) == 0x8000).sum() >= 4
    found = quantized.find_codes(wide)
    assert found is not None and found.kind == kind
    narrow = wide.to(torch.bfloat16)
    assert not torch.equal(narrow.float(), wide)   # the rounding is not a no-op on these weights
    return narrow, found


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 48), (128, 16)])   # (K, N)
def test_codes_give_the_weights_sums(kernel, kind, shape):
    _need_kernel_path(kernel)
    K, N = shape
    gen = torch.Generator().manual_seed(K + N)
    w, codes = _coded_bf16(kind, N, K, gen)
    rows, scale_min = codes.row_blocks()
    if kind == "q4_1":
        assert rows.shape == (N, K // 2) and rows.dtype == torch.uint8 and scale_min.shape == (N, K // 32, 2)
    else:
        assert rows.shape == (N, K) and rows.dtype == torch.int8 and scale_min.shape == (N, K // 32, 1)
    # the kernel's expansion and rounding give the bfloat16 weight bit for bit, ties to even included
    assert torch.equal(kernel.bf16_dots_codes_expand(rows, scale_min).view(torch.int16), w.view(torch.int16))
    for m in (1, 2, 3, 4, 5, 9):
        x = _cancelling(m, K, gen)
        got = kernel.bf16_dots_codes_linear(x, rows, scale_min)
        assert torch.equal(got, kernel.bf16_dots_linear(x, w)), m
        assert torch.equal(got, _in_torchs_order(x, w)), m


def test_the_layers_read_codes_for_few_rows_where_they_sum_in_torchs_order(kernel):
    w, codes = _coded_bf16("q4_1", 576, 1536, torch.Generator().manual_seed(4))
    routed = linear.RoutedLinear(w, None, kernel, packed=True, codes=codes)
    if not linear.bf16_dots_kernel(kernel):
        assert routed.dots_codes is None
        return
    assert routed.dots and routed.dots_codes is not None
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for rows in range(1, linear.DOTS_CODES_MAX_ROWS + 2):
            x = _cancelling(rows, 1536, gen)
            assert torch.equal(routed(x), F.linear(x, w)), rows
    # codes that do not give this weight back are not read: the kernel's own expansion turns them down
    wrong = (w.float() * 1.01).to(torch.bfloat16)
    other = linear.RoutedLinear(wrong, None, kernel, packed=True, codes=codes)
    assert other.dots and other.dots_codes is None
    assert linear._dots_codes(kernel, codes, wrong) is None and linear._dots_codes(kernel, codes, w) is not None
    assert linear.route_counts([routed, other]) == {"codes": 1, "panels": 0, "kernel": 0, "packed": 0, "dots": 2}


def test_bad_codes_are_refused(kernel):
    _need_kernel_path(kernel)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    codes, scale_min = torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 4, 2)
    assert kernel.bf16_dots_codes_linear(x, codes, scale_min).shape == (2, 8)
    assert kernel.bf16_dots_codes_linear(x, torch.zeros(8, 128, dtype=torch.int8), torch.zeros(8, 4, 1)).shape == (2, 8)
    with pytest.raises(RuntimeError, match="codes uint8 \\[N, K / 2\\] \\(Q4_1\\) or int8 \\[N, K\\]"):
        kernel.bf16_dots_codes_linear(torch.zeros(2, 96, dtype=torch.bfloat16), codes, scale_min)
    with pytest.raises(RuntimeError, match="codes uint8"):
        kernel.bf16_dots_codes_linear(x, codes.view(torch.int8), scale_min)   # int8: K codes a row
    with pytest.raises(RuntimeError, match="codes uint8"):
        kernel.bf16_dots_codes_linear(x, codes.float(), scale_min)
    with pytest.raises(RuntimeError, match="scale_min float32"):
        kernel.bf16_dots_codes_linear(x, codes, scale_min.half())
    with pytest.raises(RuntimeError, match="scale_min float32"):
        kernel.bf16_dots_codes_linear(x, codes, torch.zeros(8, 2, 2))
    with pytest.raises(RuntimeError, match="scale_min float32"):
        kernel.bf16_dots_codes_linear(x, torch.zeros(8, 128, dtype=torch.int8), scale_min)   # Q8_0 has no minimum
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        kernel.bf16_dots_codes_linear(x.float(), codes, scale_min)
