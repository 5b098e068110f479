"""ops/quantized.py and kernels/cpu/q4_linear.cpp: float32 weights that are exactly Q4_1 codes are
found, give back every bit, and the kernel reading the codes computes x W^T."""
import pytest
import torch

from ops import cpu_kernels, linear, quantized
from tests.helpers import q4_1_form


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.load()
    assert module is not None, f"the CPU kernel did not build: {cpu_kernels.failure()}"
    return module


def _weight(n, k, seed=0):
    return q4_1_form(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def test_codes_give_back_every_weight_bit_for_bit(kernel):
    weight = _weight(80, 96)
    weight[3, 32:64] = 0.25                       # a block of one value: scale 0
    weight[17] = weight[17].flip(0)               # row order and values differ per row: codes are per row
    codes = quantized.find_q4_codes(weight)
    assert codes is not None
    assert codes.codes.shape == (5, 48, 16) and codes.scales.shape == (5, 3, 16)
    assert codes.nbytes * 5 < weight.numel() * 4   # 4 bits of code + 2 floats per 32 weights
    expanded = kernel.q4_expand(codes.codes, codes.scales, codes.mins)
    assert torch.equal(expanded.view(torch.int32), weight.view(torch.int32))


@pytest.mark.parametrize("case", ["random floats", "one weight one ulp off", "rows not 16s", "inputs not 32s",
                                  "bfloat16"])
def test_weights_not_exactly_of_that_form_are_left_alone(case):
    weight = _weight(32, 64)
    if case == "random floats":
        weight = torch.randn(32, 64)
    elif case == "one weight one ulp off":
        weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(10.0))
    elif case == "rows not 16s":
        weight = _weight(24, 64)
    elif case == "inputs not 32s":
        weight = q4_1_form(torch.randn(32, 64))[:, :48].contiguous()
    else:
        weight = weight.to(torch.bfloat16)
    assert quantized.find_q4_codes(weight) is None


@pytest.mark.parametrize("n", [16, 32, 48, 80, 176])   # panels of 1, 2 and 3 groups, and mixes
def test_kernel_computes_x_times_w_transposed(kernel, n):
    weight = _weight(n, 160, seed=n)
    codes = quantized.find_q4_codes(weight)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 5, 7, 8, 9, 16, 17, 70):     # every tile height and a tail after full tiles
        x = torch.randn(rows, 160, generator=gen)
        got = kernel.q4_linear(x, codes.codes, codes.scales, codes.mins)
        want = (x.double() @ weight.double().T).float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch_it_comes_in(kernel):
    weight = _weight(96, 128, seed=3)
    codes = quantized.find_q4_codes(weight)
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(2))
    together = kernel.q4_linear(x, codes.codes, codes.scales, codes.mins)
    for i in (0, 7, 8, 20):
        alone = kernel.q4_linear(x[i:i + 1].contiguous(), codes.codes, codes.scales, codes.mins)
        assert torch.equal(alone[0], together[i])


def test_kernel_refuses_what_does_not_fit(kernel):
    codes = quantized.find_q4_codes(_weight(32, 64))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        kernel.q4_linear(torch.randn(2, 96), codes.codes, codes.scales, codes.mins)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.q4_linear(torch.randn(2, 64, dtype=torch.float64), codes.codes, codes.scales, codes.mins)


def test_routed_linear_reads_codes_at_every_row_count_and_packs_nothing(kernel, monkeypatch):
    weight = _weight(64, 96, seed=5)
    routed = linear.RoutedLinear(weight, None, kernel, packed=True)
    assert routed.q4 is not None and routed.packed is None     # no second float32 copy for MKL
    calls = []
    real = kernel.q4_linear
    monkeypatch.setattr(kernel, "q4_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    with torch.no_grad():   # training keeps torch's F.linear
        for rows in (1, 9, 300):
            x = torch.randn(1, rows, 96)
            torch.testing.assert_close(routed(x), torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert calls == [1, 9, 300]
    plain = linear.RoutedLinear(weight, None, kernel, packed=True, codes=False)
    assert plain.q4 is None
    assert linear.RoutedLinear(weight, torch.zeros(64), kernel, packed=False).q4 is None   # it adds no bias
