"""ops/linear.warm_up: oneDNN's bfloat16 GEMM run at start for every small row count, once per weight shape."""
import pytest
import torch
import torch.nn.functional as F

from ops import linear


def _bf16(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(torch.bfloat16)


def test_each_bfloat16_shape_runs_its_route_once_at_every_row_count(monkeypatch):
    if not linear.has_packed_bf16_gemm():
        pytest.skip("oneDNN has no packed bfloat16 GEMM in this torch or for this CPU")
    a, b = (linear.RoutedLinear(_bf16(48, 32), None, None, packed=True) for _ in range(2))   # one shape
    c = linear.RoutedLinear(_bf16(16, 32), None, None, packed=True)
    biased = linear.RoutedLinear(_bf16(16, 32), torch.zeros(16, dtype=torch.bfloat16), None, packed=True)
    wide = linear.RoutedLinear(torch.randn(16, 32), None, None, packed=True)    # float32: MKL's GEMM
    unpacked = linear.RoutedLinear(_bf16(24, 32), None, None, packed=False)
    assert all(lin.packed is not None for lin in (a, b, c, biased))
    calls = []
    route = linear.RoutedLinear.route
    monkeypatch.setattr(linear.RoutedLinear, "route", lambda self, rows: calls.append((self, rows)) or route(self, rows))
    assert linear.warm_up([a, b, c, biased, wide, unpacked], rows=6) == 18
    assert calls == [(lin, rows) for lin in (a, c, biased) for rows in range(1, 7)]
    # the layers give what they gave before, F.linear's bits
    monkeypatch.undo()
    for lin in (a, b, c):
        x = _bf16(5, 32)
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_the_runners_routed_layers_are_found_in_the_model():
    # inputs a multiple of 64: the shapes every bfloat16 route takes
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(), torch.nn.Linear(128, 16, bias=False))
    model.to(torch.bfloat16)
    counts = linear.route_linears(model, packed=True, codes=False)
    found = linear.routed_in(model)
    # oneDNN's packed GEMM, or on AVX2 alone the kernel in torch's own GEMM's order (ops/linear.bf16_dots_kernel)
    assert len(found) == counts["packed"] + counts["dots"] == 2
    assert found[0].weight is model[0].weight and found[1].weight is model[2].weight
