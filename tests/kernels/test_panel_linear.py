"""Plain float32 weights (no GGUF codes) laid out once in the panels of coded_linear.cpp's tiles
(`panel_pack`, `panel_linear`) and routed there by ops/linear.py at every row count."""
import pytest
import torch

from ops import linear
from tests.kernels.test_coded_linear import _bits, _fma_chain


@pytest.fixture
def tiles(kernel):
    if not kernel.has_coded_simd():
        pytest.skip("this build's tiles are scalar: float32 weights keep the few-row kernel and MKL's GEMM")
    return kernel


# 16 and 32 outputs: a panel short of its groups (zeros after N); 400: 25 groups, several panels and a short
# last one at either width (48 or 32); K 200 and 1000: not a multiple of the AVX2 chunk, several chunks
@pytest.mark.parametrize("n,k", [(16, 40), (32, 256), (400, 200), (96, 1000)])
def test_every_output_is_the_fma_chain_over_k_at_every_row_count(tiles, n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(40, k, generator=gen)
    packed = tiles.panel_pack(weight)
    want = _fma_chain(x, weight)
    assert not torch.equal(want, (x.double() @ weight.double().T).float())   # the order shows in the bits
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 17, 24, 40):
        assert torch.equal(_bits(tiles.panel_linear(x[:rows].contiguous(), packed, n)), _bits(want[:rows])), rows


def test_the_layers_route_there_and_a_row_does_not_depend_on_its_batch(tiles):
    model = torch.nn.Sequential(torch.nn.Linear(40, 48, bias=False), torch.nn.Linear(48, 24, bias=False),
                                torch.nn.Linear(24, 32, bias=True))
    # 48 outputs: panels; 24 outputs (not whole groups of 16): the few-row kernel; a bias: neither
    assert linear.route_linears(model)["panels"] == 1
    first = model[0].forward
    assert first.panel is not None and first.rows_apart and model[1].forward.panel is None
    x = torch.randn(37, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        together = first(x)
        assert torch.equal(_bits(together), _bits(_fma_chain(x, model[0].weight.detach())))
        for i, few in ((0, 1), (5, 3), (9, 8), (20, 17)):
            assert torch.equal(first(x[i:i + few]), together[i:i + few]), (i, few)
        torch.testing.assert_close(model(x), torch.nn.functional.linear(
            torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].weight), model[1].weight),
            model[2].weight, model[2].bias), rtol=1e-5, atol=1e-5)
    # without packed copies (bench/forward_paths.py's torch route) no panels are made
    assert linear.RoutedLinear(model[0].weight, None, tiles, packed=False).panel is None


def test_the_panels_refuse_what_does_not_fit(tiles):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        tiles.panel_pack(torch.randn(24, 8))
    with pytest.raises(RuntimeError, match="float32"):
        tiles.panel_pack(torch.randn(16, 8, dtype=torch.float64))
    packed = tiles.panel_pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="panel_pack"):
        tiles.panel_linear(torch.randn(2, 9), packed, 32)        # K not the packed weight's
    with pytest.raises(RuntimeError, match="panel_pack"):
        tiles.panel_linear(torch.randn(2, 8), packed, 96)        # more outputs than its panels hold
    with pytest.raises(RuntimeError, match="float32"):
        tiles.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 32)
    shifted = torch.empty(packed.numel() + 1)[1:].view(packed.shape)   # contiguous, 4 bytes off its alignment
    shifted.copy_(packed)
    with pytest.raises(RuntimeError, match="aligned"):
        tiles.panel_linear(torch.randn(2, 8), shifted, 32)
    assert tiles.panel_linear(torch.randn(0, 8), packed, 32).shape == (0, 32)
