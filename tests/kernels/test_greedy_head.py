"""pagedserve_kernels/cpu/greedy_head.cpp through ops/greedy_head.py: the greedy token of float32 rows through a
Q8_0 output layer, from an int8 first pass and the exact logits of its candidates, is the first index of
the largest logit of the full product (coded_linear), and its logit has the same bits."""
import pytest
import torch

from ops import greedy_head, linear, quantized
from tests.helpers import bf16_head_route, cpu_flags, q8_0_form


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
                                                 head.widest, None)
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
                                                 head.widest, None)
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
                                            head.norms, head.widest, None)
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


@pytest.fixture
def bf16_pass(first_pass):
    """The kernel module, where its first pass also takes a bfloat16 output layer and the layer's route is a kernel
    whose sums the head recomputes: the AVX512-BF16 kernel (AVX512-BF16 in the build), or the one in torch's own
    order where that is the route (AVX2); not oneDNN's AMX GEMM."""
    if linear.bf16_dots_kernel(first_pass):
        assert first_pass.has_bf16_dots_argmax(), "torch's order is the route but the build has no head for it"
        return first_pass
    if not first_pass.has_bf16_argmax():
        flags = cpu_flags()
        assert "avx512_bf16" not in flags or "avx512_vnni" not in flags, \
            "the CPU has AVX512-BF16 and AVX512-VNNI but the build cannot take a bfloat16 output layer"
        pytest.skip("no AVX512-BF16 beside the first pass on this CPU")
    if not linear.bf16_dot_kernel(first_pass):
        pytest.skip("AMX tiles: oneDNN's GEMM is the bfloat16 route, which gets no head (test below)")
    return first_pass


def test_no_bfloat16_head_where_onednn_is_the_route(first_pass):
    # where a bfloat16 output layer's route is oneDNN's GEMM (a CPU with AMX tiles), whose sums the head does not
    # recompute, it gets none and every row takes the full logits; where it is the AVX512-BF16 kernel, it gets one
    weight = q8_0_form(torch.randn(640, 576, generator=torch.Generator().manual_seed(7)) * 0.05)
    module = torch.nn.Linear(576, 640, bias=False).to(torch.bfloat16)
    module.weight.data = weight.to(torch.bfloat16)
    module.forward = linear.RoutedLinear(module.weight.data, None, first_pass, True, codes=quantized.find_codes(weight))
    head = greedy_head.build(module, first_pass)
    assert (head is not None) == bf16_head_route(first_pass)


def _bf16_head(kernel, weight):
    """A bfloat16 output layer rounded from the float32 Q8_0 `weight`, routed as the runner routes it (the
    AVX512-BF16 kernel for many rows, or torch's order), and its greedy head."""
    wide = quantized.find_codes(weight)
    narrow = weight.to(torch.bfloat16)
    routed = linear.RoutedLinear(narrow, None, kernel, True, codes=wide)
    assert (routed.dot is not None or routed.dots) and routed.plain_codes is wide and wide.rounds_to(kernel, narrow)
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    module.weight.data = narrow
    module.forward = routed
    head = greedy_head.build(module, kernel)
    assert head is not None and head.weight is not None and head.dots == routed.dots
    # the codes it was rounded from are the first pass's, what they miss the rounding alone
    assert torch.equal(head.scales, wide.scales) and head.resids is not None
    return routed, head


def _bf16_full(kernel, routed, x):
    """The full bfloat16 logits (the route's, as the sampler gets them) and their first argmax."""
    logits = routed(x)
    best, index, _ = kernel.greedy_logsumexp(logits)
    assert torch.equal(index, logits.float().argmax(-1))   # the first of equal largest values
    return logits, index


@pytest.mark.parametrize("rows", [1, 5, 24])
@pytest.mark.parametrize("plain", [False, True])
def test_bfloat16_token_is_the_full_products(bf16_pass, plain, rows):
    """A bfloat16 layer rounded from Q8_0 codes, or a plain one (codes found near it). K = 576 as SmolLM2's: the
    AVX512-BF16 kernel sums it in two chunks (512 inputs, then 64), torch's order in nine blocks of 64."""
    weight = torch.randn(640, 576, generator=torch.Generator().manual_seed(7)) * 0.05
    routed, head = _plain_head(bf16_pass, weight.to(torch.bfloat16)) if plain else \
        _bf16_head(bf16_pass, q8_0_form(weight))
    x = _rows(576, seed=8)[:rows].to(torch.bfloat16)
    x[4 % rows] = torch.randn(576, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)   # no subnormals
    _, index = _plain_full(bf16_pass, routed, x)
    tokens, counts = head.tokens(x)
    assert tokens == index.tolist()
    assert min(counts) >= 1 and counts[0] < weight.shape[0] // 4, counts


def test_bfloat16_ties_of_rounded_logits_go_to_the_first_index(bf16_pass):
    """Logits a float32 step apart round to one bfloat16 value: the first index of the tie is the token, also
    where a later one's float32 sum is larger. Outputs that are one row's weights with a code or two nudged
    make such near ties on every row."""
    g = torch.Generator().manual_seed(10)
    base = q8_0_form(torch.randn(40, 576, generator=g) * 0.05)
    weight = base.repeat(16, 1)
    nudge = torch.randint(0, 576, (640,), generator=g)
    scale = weight.abs().view(640, 18, 32).amax(-1) / 127
    weight[torch.arange(640), nudge] += scale[torch.arange(640), nudge // 32].half().float()
    weight = q8_0_form(weight)
    routed, head = _bf16_head(bf16_pass, weight)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    logits, index = _bf16_full(bf16_pass, routed, x)
    ties = (logits == logits.max(-1, keepdim=True).values).sum(-1)
    assert (ties > 1).sum() >= 8, ties      # the case is really there
    tokens, _ = head.tokens(x)
    assert tokens == index.tolist()


def test_bfloat16_many_rows_at_every_scale(bf16_pass):
    weight = q8_0_form(torch.randn(1024, 576, generator=torch.Generator().manual_seed(11)) * 0.05)
    routed, head = _bf16_head(bf16_pass, weight)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(120, 576, generator=g) * torch.logspace(-6, 4, 120)[:, None]
    x[::7, 5] *= 300.0
    x = x.to(torch.bfloat16)
    _, index = _bf16_full(bf16_pass, routed, x)
    assert head.tokens(x)[0] == index.tolist()


def test_bfloat16_rows_with_subnormal_values_take_the_full_logits(bf16_pass):
    weight = q8_0_form(torch.randn(640, 576, generator=torch.Generator().manual_seed(13)) * 0.05)
    routed, head = _bf16_head(bf16_pass, weight)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    x[1, 9] = 1e-30   # VDPBF16PS would flush its products' sums near there
    tokens, counts = head.tokens(x)
    assert tokens[0] >= 0 and tokens[2] >= 0
    if head.dots:   # torch's order takes them as FMAs do: the row's token is the full logits'
        assert tokens == _bf16_full(bf16_pass, routed, x)[1].tolist() and counts[1] > 0
    else:
        assert tokens[1] == -1 and counts[1] == 0


# plain output layers (no codes): Q8_0 codes found near the weight, the bound widened by what they miss, the
# candidates' logits the weight's own through its route

def _plain_head(kernel, weight):
    """`weight` [N, K] (float32 or bfloat16) as a routed output layer, as the runner routes it, and its head."""
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    module.weight.data = weight
    linear.route_linears(module)
    routed = module.forward
    assert routed.codes is None and (routed.panel is not None or routed.dot is not None or routed.dots)
    head = greedy_head.build(module, kernel)
    assert head is not None and head.codes is None and head.resids is not None and head.weight.dtype == weight.dtype
    return routed, head


def _plain_full(kernel, routed, x):
    """The route's full logits (panel_linear's, bf16_linear's or bf16_dots_linear's) and the sampler's first argmax
    of them."""
    with torch.no_grad():
        logits = routed(x)
    best, index, _ = kernel.greedy_logsumexp(logits)
    return best, index


@pytest.mark.parametrize("rows", [1, 3, 9, 24])
def test_plain_float32_token_and_logit_are_the_panels(first_pass, rows):
    if not first_pass.has_coded_simd():
        pytest.skip("no float32 panels in this build")
    weight = torch.randn(640, 96, generator=torch.Generator().manual_seed(20)) * 0.05
    routed, head = _plain_head(first_pass, weight)
    x = _rows(96)[:rows].contiguous()
    best, index = _plain_full(first_pass, routed, x)
    tokens, logit, counts = first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms,
                                                 head.widest, head.weight, head.resids)
    assert torch.equal(tokens, index) and torch.equal(logit.view(torch.int32), best.view(torch.int32))
    if rows > 3:
        assert counts[3] == 640   # all logits 0
    assert counts[0] < 640 // 4, counts


def test_plain_float32_many_rows_and_ties(first_pass):
    """Every scale of x, outlier channels, and outputs that are copies of one another (the first index wins)."""
    if not first_pass.has_coded_simd():
        pytest.skip("no float32 panels in this build")
    g = torch.Generator().manual_seed(21)
    weight = torch.randn(1024, 128, generator=g) * torch.logspace(-3, 1, 1024)[:, None]
    for n in (1020, 990, 1001):
        weight[n] = weight[1000]
    routed, head = _plain_head(first_pass, weight)
    x = torch.randn(200, 128, generator=g) * torch.logspace(-6, 4, 200)[:, None]
    x[::7, 5] *= 300.0
    x[::11] = weight[1000] * torch.logspace(-3, 3, 19)[:, None]   # rows whose largest logits are the copies' ties
    best, index = _plain_full(first_pass, routed, x.contiguous())
    assert (index[::11] == 990).all()
    tokens = head.tokens(x)[0]
    assert tokens == index.tolist()


def test_plain_bfloat16_many_rows_at_every_scale(bf16_pass):
    g = torch.Generator().manual_seed(25)
    weight = (torch.randn(1024, 576, generator=g) * torch.logspace(-3, 1, 1024)[:, None]).to(torch.bfloat16)
    routed, head = _plain_head(bf16_pass, weight)
    x = torch.randn(120, 576, generator=g) * torch.logspace(-6, 4, 120)[:, None]
    x[::7, 5] *= 300.0
    x = x.to(torch.bfloat16)
    _, index = _plain_full(bf16_pass, routed, x)
    assert head.tokens(x)[0] == index.tolist()


def test_near_codes_bound_what_they_miss():
    """The codes found near a plain weight: each within half a step of it, and the norms the bound weighs
    (of scale * code, of w - scale * code) never under the real ones, one float32 step at most over."""
    g = torch.Generator().manual_seed(26)
    weight = torch.randn(48, 64, generator=g) * torch.logspace(-4, 2, 48)[:, None]
    weight[5, :32] = 0.0   # a block of zeros: scale 0, codes 0
    near = greedy_head.NearCodes(weight)
    codes = near.codes.view(3, 2, 32, 16).double()
    scales = near.scales.double()[:, :, None, :]
    w = weight.double().view(3, 16, 2, 32).permute(0, 2, 3, 1)
    assert (codes.abs() <= 127).all() and (near.scales[0, 0, 5] == 0)
    assert ((w - codes * scales).abs() <= scales / 2 * (1 + 1e-9)).all()
    assert (near.scales.double() >= w.abs().amax(2) / 127).all()   # rounded up: no code clamped
    for got, exact in ((near.resids, (w - codes * scales).pow(2).sum(2).sqrt()),
                       (near.norms, (codes * scales).pow(2).sum(2).sqrt())):
        assert (got.double() >= exact).all()
        assert (torch.nextafter(got, torch.tensor(float("-inf"))).double() < exact).all()
    assert (near.absums.double() >= w.abs().sum(2)).all()


def test_the_kernel_refuses_a_plain_weight_without_its_bound(first_pass):
    weight = torch.randn(640, 96, generator=torch.Generator().manual_seed(27)) * 0.05
    near = greedy_head.NearCodes(weight)
    head = greedy_head.GreedyHead(first_pass, near, weight)
    x = torch.randn(2, 96)
    narrow = head.widest[:, :2].contiguous()
    with pytest.raises(RuntimeError, match="a weight needs resid"):
        first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms, narrow, weight, None)
    with pytest.raises(RuntimeError, match="widest"):
        first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms, narrow, weight, head.resids)
    with pytest.raises(RuntimeError, match="and resid a weight"):
        first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms, head.widest, None,
                             head.resids)
    with pytest.raises(RuntimeError, match="codes or a weight"):
        first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms, narrow, None, None)
    # torch's order (dots) is a bfloat16 layer's, with K a multiple of 64
    with pytest.raises(RuntimeError, match="dots takes a bfloat16"):
        first_pass.q8_argmax(x, head.packed, None, head.scales, head.absums, head.norms, head.widest, weight,
                             head.resids, True)
    # without panels (no packed copies) a float32 layer's logits are not the FMA chain: no head
    plain = torch.nn.Linear(96, 640, bias=False)
    plain.weight.data = weight
    linear.route_linears(plain, packed=False)
    assert greedy_head.build(plain, first_pass) is None
