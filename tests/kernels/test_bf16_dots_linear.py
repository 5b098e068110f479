"""bfloat16 products in the order of torch's own GEMM (pagedserve_kernels/cpu/bf16_dots_linear.cpp), the
route of bfloat16 layers where oneDNN has no bfloat16 GEMM for the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ops import linear


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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64])
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
