"""pagedserve_kernels/cpu/greedy_head.cpp through ops/greedy_head.py: the greedy token of float32 rows through a
Q8_0 output layer, from an int8 first pass and the exact logits of its candidates, is the first index of
the largest logit of the full product (coded_linear), and its logit has the same bits."""
import pytest
import torch

from ops import greedy_head, linear, quantized
from tests.helpers import cpu_flags, q8_0_form


@pytest.fixture
def first_pass(kernel):
    """The kernel module, where it has the first pass: AVX512-VNNI's, or AVX2's (VPMADDUBSW)."""
    if not kernel.has_q8_argmax():
        # the build chooses by the compiler's -march=native: a CPU with neither has no first pass
        flags = cpu_flags()
        assert "avx512_vnni" not in flags and not {"avx2", "fma"} <= flags, \
            "the CPU has AVX512-VNNI or AVX2 but the build has no q8_argmax"
        pytest.skip("neither AVX512-VNNI nor AVX2 on this CPU")
    return kernel


def _head(n=640, k=96, seed=0):
    weight = q8_0_form(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    codes = quantized.find_codes(weight)
    assert codes is not None and codes.kind == "q8_0"
    return weight, codes


def _full(kernel, codes, x):
    """The full product's logits and their first argmax, as the sampler takes it."""
    logits = kernel.coded_linear(x, codes.codes, codes.scales, None)
    best, index, _ = kernel.greedy_logsumexp(logits)
    return logits, best, index


def _rows(k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, k, generator=g)
    x[1, 40] = 60.0                       # an outlier channel, as final hidden states have
    x[2, :32] *= 1e3                      # a whole block far larger than the others
    x[3] = 0.0                            # every logit 0: the first index
    x[4] = torch.randn(k, generator=g) * 1e-39   # subnormal: 127 / max overflows
    x[5, ::3] = 0.0
    x[6] *= 1e-3
    return x


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 24])
def test_token_and_logit_are_the_full_products(first_pass, rows):
    weight, codes = _head()
    head = greedy_head.GreedyHead(first_pass, codes)
    x = _rows(weight.shape[1])[:rows].contiguous()
    logits, best, index = _full(first_pass, codes, x)
    tokens, logit, counts = first_pass.q8_argmax(x, head.packed, codes.codes, codes.scales, head.absums, head.norms,
                                                 head.widest)
    assert torch.equal(tokens, index)
    assert torch.equal(logit.view(torch.int32), best.view(torch.int32))
    assert (counts >= 1).all() and (counts <= weight.shape[0]).all()
    if rows > 3:
        assert counts[3] == weight.shape[0]   # all logits tie at 0: every one is a candidate
    # the point of it: most logits of an ordinary row are never computed exactly
    assert counts[0] < weight.shape[0] // 4, counts


def test_ties_go_to_the_first_index(first_pass):
    weight, codes = _head()
    weight = weight.clone()
    for n in (300, 77, 600):                  # row 77 the first of three equal rows
        weight[n] = weight[5] * 4
    codes = quantized.find_codes(weight)
    head = greedy_head.GreedyHead(first_pass, codes)
    x = (weight[5] + 0.01 * torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(3)))[None].contiguous()
    logits, best, index = _full(first_pass, codes, x)
    assert int(index) == 77 and logits[0, 300] == logits[0, 77] == logits[0, 600]
    tokens, logit, counts = first_pass.q8_argmax(x, head.packed, codes.codes, codes.scales, head.absums, head.norms,
                                                 head.widest)
    assert int(tokens) == 77 and torch.equal(logit, best) and counts[0] >= 3


def test_many_random_rows_against_the_full_product(first_pass):
    """The bound is a proof, not a tolerance: no row of many, at every scale, may pick another token."""
    weight, codes = _head(n=1024, k=128, seed=5)
    head = greedy_head.GreedyHead(first_pass, codes)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(200, 128, generator=g) * torch.logspace(-6, 4, 200)[:, None]
    x[::7, 5] *= 300.0
    _, best, index = _full(first_pass, codes, x.contiguous())
    tokens, logit, _ = first_pass.q8_argmax(x.contiguous(), head.packed, codes.codes, codes.scales, head.absums,
                                            head.norms, head.widest)
    assert torch.equal(tokens, index) and torch.equal(logit, best)


def test_a_row_with_a_nan_or_an_infinity_is_left_to_the_full_logits(first_pass):
    weight, codes = _head()
    head = greedy_head.GreedyHead(first_pass, codes)
    x = _rows(weight.shape[1])[:3].clone()
    x[0, 7] = float("nan")
    x[2, 90] = float("inf")
    tokens, counts = head.tokens(x)
    assert tokens[0] == -1 and tokens[2] == -1 and counts[0] == counts[2] == 0
    assert tokens[1] == int(_full(first_pass, codes, x[1:2].contiguous())[2])


def test_build_takes_only_a_float32_q8_0_head(first_pass, monkeypatch):
    q8 = torch.nn.Linear(96, 640, bias=False)
    q8.weight.data = _head()[0]
    linear.route_linears(q8, codes=True)
    built = greedy_head.build(q8, first_pass)
    assert built is not None and built.codes is q8.forward.codes   # the route's codes, not found again
    assert built.nbytes == 640 * 96 + 2 * 640 * 3 * 4 + 2 * 40 * 3 * 4
    plain = torch.nn.Linear(96, 640, bias=False)          # random floats: no codes
    assert greedy_head.build(plain, first_pass) is None
    assert greedy_head.build(q8.to(torch.bfloat16), first_pass) is None
    assert greedy_head.build(q8.float(), None) is None
    monkeypatch.setenv("PAGEDSERVE_GREEDY_HEAD", "0")
    assert greedy_head.build(q8.float(), first_pass) is None


def test_norms_are_the_blocks_norms_rounded_up():
    """The bound weighs x's rounding by each block's Euclidean norm: never under the real one, and no more
    than one float32 step over it, whichever chunk of groups computed it."""
    weight, codes = _head(n=640, k=96)
    norms = torch.empty(codes.scales.shape, dtype=torch.float32)
    blocks = codes.codes.view(40, 3, 32, 16)
    for g in range(0, 40, 7):   # chunks that do not divide the groups
        norms[g:g + 7] = greedy_head._norms_up(blocks[g:g + 7], codes.scales[g:g + 7])
    exact = weight.double().view(40, 16, 3, 32).pow(2).sum(3).sqrt().permute(0, 2, 1)   # [G, B, 16]
    assert (norms.double() >= exact).all()
    below = torch.nextafter(norms, torch.tensor(float("-inf")))
    assert (below.double() < exact).all()
