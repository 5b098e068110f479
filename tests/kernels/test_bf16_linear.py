"""The bfloat16 GEMM on AVX512-BF16 dot products (pagedserve_kernels/cpu/bf16_linear.cpp) and its route."""
from __future__ import annotations

import pytest
import torch

from ops import linear
from tests.helpers import cpu_flags


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T of the same bfloat16 numbers in float64 (exact here), rounded once to bfloat16."""
    return (x.double() @ w.double().T).to(torch.bfloat16)


def test_the_build_has_the_dot_product_where_the_cpu_has_it(kernel):
    # the kernels are built for the CPU they run on (-march=native)
    assert kernel.has_bf16_dot() == ("avx512_bf16" in cpu_flags())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("out_features", [16, 32, 48, 80, 208])   # panels of 1, 2, 3 groups and remainders
def test_products_are_the_exact_sums_rounded_once_and_rows_do_not_depend_on_each_other(kernel, rows, out_features):
    if not kernel.has_bf16_dot():
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            kernel.bf16_linear(torch.zeros(1, 4, dtype=torch.bfloat16), kernel.bf16_pack(torch.zeros(16, 4).bfloat16()))
        return
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, 576, generator=gen).to(torch.bfloat16)
    got = kernel.bf16_linear(x, kernel.bf16_pack(w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # float32 sums in another order than the exact one: at most one bfloat16 step off, and rarely
    steps = (got.view(torch.int16).int() - _exact(x, w).view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
    # each row alone gives its bits in the batch: no result depends on the rows beside it
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(kernel.bf16_linear(x[r:r + 1].contiguous(), kernel.bf16_pack(w)), got[r:r + 1])


def test_pack_and_product_refuse_what_they_cannot_compute(kernel):
    w = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="N a multiple of 16 and K even"):
        kernel.bf16_pack(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.bf16_pack(w.float())
    if not kernel.has_bf16_dot():
        return
    packed = kernel.bf16_pack(w)
    with pytest.raises(RuntimeError, match="K matching x"):
        kernel.bf16_linear(torch.zeros(2, 66, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        kernel.bf16_linear(torch.zeros(2, 64), packed)


def test_bfloat16_layers_take_the_dot_kernel_where_the_cpu_has_no_amx(kernel):
    w = torch.randn(64, 96).to(torch.bfloat16)
    routed = linear.RoutedLinear(w, None, kernel, packed=True, codes=None)
    uses_dot = linear.bf16_dot_kernel(kernel)
    assert uses_dot == (kernel.has_bf16_dot() and "amx_bf16" not in cpu_flags())
    assert (routed.dot is not None) == uses_dot
    # one copy laid out for many rows, not two: the dot kernel's, the AMX tiles' or oneDNN's
    assert (routed.tiles is not None) == linear.amx_tiles(kernel)
    assert sum(copy is not None for copy in (routed.dot, routed.tiles, routed.packed)) == 1 \
        or not linear.has_packed_bf16_gemm()
    with torch.no_grad():
        for rows in (1, 5, 40):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            got = routed(x)
            steps = (got.view(torch.int16).int() - _exact(x, w).view(torch.int16).int()).abs()
            assert steps.max() <= 1
    # a layer with a bias keeps torch's op (the kernels add no bias), and odd shapes keep oneDNN
    assert linear.RoutedLinear(w, torch.zeros(64, dtype=torch.bfloat16), kernel, packed=True).dot is None
    assert linear.RoutedLinear(torch.randn(40, 96).to(torch.bfloat16), None, kernel, packed=True).dot is None
