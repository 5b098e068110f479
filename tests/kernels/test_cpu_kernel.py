"""The C++ CPU decode kernel (pagedserve_kernels/cpu/paged_decode.cpp) against dense attention.

The kernel must build on the machines CI runs on (a C++ compiler is part of the environment);
a build failure fails these tests instead of silently testing the fallback.
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from ops import attention, cpu_kernels, sdpa_order
from tests.kernels.conftest import PagedBatch, dense_attention


def _batch(seed, num_seqs, max_len, heads, kv_heads, head_dim, block_size, decode_only=True):
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
    seq_lens[0] = block_size            # a context that ends exactly on a block boundary
    q_lens = [1 if decode_only or i % 4 else min(s, rng.randint(2, 9)) for i, s in enumerate(seq_lens)]
    return PagedBatch(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=torch.float32, device="cpu", seed=seed)


# (heads, kv heads, head_dim): SmolLM2's 9/3/64, plain multi-head, 4 query heads per KV head with
# head_dim 128, 2 per KV head with head_dim 40 (a multiple of 8 but not of 16: the AVX2 dot's last block
# and a value walk of one slice), and head_dim 36 (not a multiple of 8: the scalar loops instead of AVX2)
SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 128), (8, 4, 40), (6, 3, 36)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_seqs", [2, 40])   # few rows: one item per KV head; many: one per row
def test_decode_matches_dense_attention(kernel, heads, kv_heads, head_dim, block_size, num_seqs):
    batch = _batch(block_size + num_seqs, num_seqs, 150, heads, kv_heads, head_dim, block_size)
    out = attention.paged_attention(*batch.args(), max_query_len=1)
    torch.testing.assert_close(out, dense_attention(batch), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_mixed_batch_short_prompt_runs_in_kernel_long_ones_in_reference(kernel, heads, kv_heads, head_dim,
                                                                        monkeypatch):
    # decode rows, prompt runs of 2-9 tokens and of exactly the limit (the kernel's, one row per token),
    # and runs past the limit: a whole prompt and a chunk after cached context (the reference's)
    limit = attention.KERNEL_MAX_QUERY
    seq_lens = [16, 40, 9, 130, limit, limit + 1, 300, 75]
    q_lens = [1, 1, 9, 2, limit, limit + 1, limit + 20, 1]
    batch = PagedBatch(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                       dtype=torch.float32, device="cpu", seed=7)
    work = attention.kernel_rows(batch.query_start_loc, batch.seq_lens, batch.block_tables)
    assert work.rest == [5, 6]
    assert work.tokens.shape[0] == sum(q for q in q_lens if q <= limit)
    assert work.lens[:4].tolist() == [16, 40, 1, 2]        # prompt tokens see their own causal context
    extended = []
    real = attention.reference.extend_one
    monkeypatch.setattr(attention.reference, "extend_one",
                        lambda q, *a, **kw: extended.append(q.shape[0]) or real(q, *a, **kw))
    torch.testing.assert_close(attention.paged_attention(*batch.args()), dense_attention(batch),
                               atol=2e-6, rtol=1e-5)
    assert extended == [limit + 1, limit + 20]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_bfloat16_rows_in_the_kernels_own_order_are_the_float32_result_rounded_once(kernel, heads, kv_heads,
                                                                                   head_dim):
    # decode rows and short prompt runs over a bfloat16 pool, without torch's SDPA order (lanes 0): the kernel
    # widens every value to float32, so its output is the float32 attention of the same (bfloat16) numbers,
    # rounded once
    seq_lens, q_lens = [16, 40, 9, 130, 75], [1, 1, 9, 2, 1]
    batch = PagedBatch(seq_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                       dtype=torch.bfloat16, device="cpu", seed=5)
    own = attention.Backend("cpu", torch.bfloat16, False, kernel, sdpa_lanes=0)
    out = attention.paged_attention(*batch.args(), backend=own)
    assert out.dtype == torch.bfloat16
    expected = dense_attention(batch).to(torch.bfloat16)   # float32 over the same bfloat16 numbers
    # one rounding apart at most: float32 sums in another order may round to the neighbouring bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-5, rtol=2 ** -7)
    assert (out == expected).float().mean() > 0.95


def _sdpa_case(queries, keys, seed):
    # random bfloat16 attention in a paged pool, and transformers' result for it
    if not attention.torch_sdpa_lanes(torch.bfloat16):
        pytest.skip(f"torch's CPU vectors here ({torch.backends.cpu.get_cpu_capability()}) are not AVX2 or AVX-512")
    return sdpa_order.sdpa_case(queries, keys, seed)


@pytest.mark.parametrize("context", [5, 40, 300, 600, 1100])
def test_bfloat16_decode_rows_follow_torchs_sdpa_as_transformers_calls_it(kernel, context):
    # transformers' bfloat16 SDPA on a CPU (torch's flash kernel) rounds the softmax's numerators to bfloat16
    # and takes them from a fast exponential, over blocks of 512 keys: the default bfloat16 backend follows
    # it (pagedserve_kernels/cpu/paged_decode.cpp); contexts past one and two of those blocks
    args, expected = _sdpa_case(1, context, seed=context)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    assert chosen.sdpa_lanes == attention.torch_sdpa_lanes(torch.bfloat16)
    got = attention.paged_attention(*args, backend=chosen)
    own = attention.paged_attention(*args, backend=attention.Backend("cpu", torch.bfloat16, False, kernel))
    # the two products' float32 sums add in MKL's order where the start-up check found it to give torch's
    # bits (ops/sdpa_order.py), else in the kernel's: then rarely one bfloat16 step apart
    assert torch.equal(got, expected) if chosen.mkl_order else (got == expected).float().mean() > 0.99
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=2 ** -7)
    if context > 5:   # (five keys make few ties to break)
        assert (own == expected).float().mean() < 0.9   # the kernel's own order is a different result


def test_bfloat16_prompt_rows_follow_torchs_causal_sdpa_over_the_prompt(kernel):
    # a 51-token prompt computed as one row per token (as prompt runs up to KERNEL_MAX_QUERY are): each row
    # follows transformers' one call over the whole prompt (its vectors of 16 keys counted over 51, the
    # keys after the row masked)
    args, expected = _sdpa_case(51, 51, seed=51)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    got = attention.paged_attention(*args, backend=chosen)
    assert torch.equal(got, expected) if chosen.mkl_order else (got == expected).float().mean() > 0.99
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=2 ** -7)


@pytest.mark.parametrize("prompt, runs", [(141, (100, 41)), (141, (60, 81)), (192, (192,)), (193, (100, 93)), (120, (1, 119))])
def test_bfloat16_prompt_rows_in_chunks_are_transformers_one_call_over_the_prompt(kernel, prompt, runs):
    # a prompt that comes in runs over several steps, each run within KERNEL_MAX_QUERY (as the runner passes
    # them: the prompt's length known): each row has the bits of transformers' one call over the whole prompt
    assert max(runs) <= attention.KERNEL_MAX_QUERY
    args, expected = _sdpa_case(prompt, prompt, seed=prompt)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    done = 0
    for run, (got, rows) in zip(runs, sdpa_order.prompt_runs(args, runs, chosen)):
        assert rows.rest == []   # the kernel's, not the reference's
        want = expected[done:done + run]
        assert torch.equal(got, want) if chosen.mkl_order else (got == want).float().mean() > 0.99
        done += run


@pytest.mark.parametrize("prompt, runs", [(300, (250, 50)), (700, (300, 400)), (400, (400,))])
def test_long_runs_of_part_of_a_prompt_take_the_kernel_where_its_rows_are_transformers(kernel, prompt, runs):
    # past KERNEL_MAX_QUERY, a run that is the whole prompt is torch's SDPA over it (transformers' own call); where
    # the kernel follows transformers' calls at every prompt length (Backend.prompt_chunks: the tile order), a run
    # of part of the prompt is the kernel's, whose rows are the whole prompt's call's (SDPA over the run alone
    # sums a 250-token run's keys in other groups than a call over 300)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    assert chosen.prompt_chunks == (chosen.mkl_order and kernel.sdpa_tile_order())
    if not chosen.prompt_chunks:
        pytest.skip("the kernel follows transformers' calls past KERNEL_MAX_QUERY tokens only in the tile order (AMX)")
    args, expected = _sdpa_case(prompt, prompt, seed=prompt)
    done = 0
    for run, (got, rows) in zip(runs, sdpa_order.prompt_runs(args, runs, chosen)):
        assert rows.rest == ([0] if run == prompt else [])
        assert torch.equal(got, expected[done:done + run])
        done += run


def test_bfloat16_write_kv_copies_rows_bit_for_bit(kernel):
    from ops import reference
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 4 * 8, generator=gen).to(torch.bfloat16)
    k, v = qkv[:, :16].view(5, 2, 8), qkv[:, 16:].view(5, 2, 8)
    slots = torch.tensor([7, -1, 0, 12, 3])
    caches = [torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    kernel.write_kv(k, v, caches[0], caches[1], slots)
    reference.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="the same for k, v and the caches"):
        kernel.write_kv(k, v, caches[0].float(), caches[1].float(), slots)


def test_query_as_the_model_hands_it_over_strided_heads(kernel):
    # the model's query arrives as [heads, tokens, dim] transposed to [tokens, heads, dim]
    batch = _batch(3, 12, 70, 9, 3, 64, 16)
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not batch.query.is_contiguous()
    torch.testing.assert_close(attention.paged_attention(*batch.args(), max_query_len=1), dense_attention(batch),
                               atol=2e-6, rtol=1e-5)


def test_long_contexts_and_peaked_scores(kernel):
    # 3000-token contexts, and queries scaled up so that most probabilities underflow to zero
    batch = _batch(11, 3, 3000, 9, 3, 64, 16)
    batch.query = batch.query * 30
    torch.testing.assert_close(attention.paged_attention(*batch.args(), max_query_len=1), dense_attention(batch),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_how_the_rows_are_shared_out(kernel, dtype):
    # the threads take ranges of rows of about equal work (the contexts, longest first here, as a step's
    # rows come): each row's output is the one it gets alone, bit for bit
    gen = torch.Generator().manual_seed(11)
    rows, block, kv_heads, heads, dim = 40, 16, 3, 9, 64
    lens = torch.randint(1, 300, (rows,), generator=gen).sort(descending=True).values.to(torch.int32)
    width = -(-int(lens.max()) // block)
    num_blocks = rows * width + 1
    k_cache, v_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
    query = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    tokens = torch.arange(rows, dtype=torch.int64)

    def decode(pick):
        out = torch.empty(len(pick), heads, dim, dtype=dtype)
        kernel.paged_decode(out, query[pick].contiguous(), k_cache, v_cache, tables[pick].contiguous(),
                            lens[pick].contiguous(), torch.arange(len(pick), dtype=torch.int64), dim ** -0.5, 0, 0.0,
                            None, None, 0, None, 0)
        return out
    together = decode(tokens)
    for r in (0, 1, rows // 2, rows - 1):
        assert torch.equal(together[r], decode(torch.tensor([r]))[0]), r


def test_bad_block_id_is_an_error_not_a_crash(kernel):
    batch = _batch(5, 4, 60, 9, 3, 64, 16)
    batch.block_tables[2, 0] = batch.k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="block id"):
        attention.paged_attention(*batch.args(), max_query_len=1)


def test_backend_reports_the_kernel_and_its_fallbacks(kernel, monkeypatch):
    cpu = torch.device("cpu")
    assert attention.choose(cpu, torch.float32).describe().startswith("cpu kernel")
    assert attention.choose(cpu, torch.bfloat16).describe().startswith("cpu kernel")
    assert attention.choose(cpu, torch.float16).describe().startswith("torch reference (the CPU kernel is float32 and bfloat16")
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert attention.choose(cpu, torch.float32).describe() == "torch reference (disabled by PAGEDSERVE_CPU_KERNELS=0)"


# --- the few-row linear kernel ---------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (37, 7), (64, 1)])
def test_skinny_linear_matches_torch_linear(kernel, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    torch.testing.assert_close(kernel.skinny_linear(x, w), torch.nn.functional.linear(x, w),
                               atol=1e-4, rtol=1e-5)


def test_skinny_linear_refuses_what_it_cannot_compute(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel.skinny_linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernel.skinny_linear(torch.randn(2, 8), torch.randn(3, 9))


def test_model_layers_route_by_rows_and_keep_hooks(kernel, monkeypatch):
    from bench._common import plain_linears     # bench/overhead.py's bare baseline undoes the routing
    from ops import linear
    model = torch.nn.Sequential(torch.nn.Linear(40, 24, bias=False), torch.nn.Linear(24, 16, bias=True),
                                torch.nn.Linear(16, 8, bias=False))
    hooked = []
    model[2].register_forward_hook(lambda m, i, o: hooked.append(o.shape))
    with torch.no_grad():
        few, many = torch.randn(1, 3, 40), torch.randn(1, 20, 40)
        expect_few, expect_many = model(few), model(many)
        packed = linear.has_packed_gemm()
        # the layer with a bias never takes the kernel (it adds no bias); no output count is a multiple of 16
        # (the panels' groups), so every layer takes packed GEMM
        assert linear.route_linears(model) == {"codes": 0, "panels": 0, "kernel": 2, "packed": 3 if packed else 0, "dots": 0}
        calls, gemm_rows = [], []
        real = kernel.skinny_linear
        monkeypatch.setattr(kernel, "skinny_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
        if packed:
            real_gemm = torch.ops.mkl._mkl_linear
            monkeypatch.setattr(linear, "_packed_gemm", lambda *a: gemm_rows.append(a[-1]) or real_gemm(*a))
        torch.testing.assert_close(model(few), expect_few, atol=1e-5, rtol=1e-5)
        assert calls == [3, 3]
        torch.testing.assert_close(model(many), expect_many, atol=1e-5, rtol=1e-5)
        assert calls == [3, 3]                               # 20 rows: GEMM
        assert gemm_rows == ([3, 20, 20, 20] if packed else [])
        with plain_linears(model):
            model(few)
        assert calls == [3, 3]
        model(few)
        assert calls == [3, 3, 3, 3]                         # routed again after the block
    assert len(hooked) == 6                                  # every forward, routed or not, ran the hook


def test_a_call_takes_the_route_chosen_for_its_row_count_once(kernel):
    """RoutedLinear keeps one route per row count (counts past the last threshold share one): every call
    gives the bits of the route chosen afresh for its rows, in any order of row counts."""
    from ops import linear
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 40, generator=gen)
    routed = linear.RoutedLinear(weight, None, kernel, packed=True, codes=False)
    counts = (20, 1, 9, 8, 3, 40, 1, 12, 8)
    with torch.no_grad():
        for rows in counts:
            x = torch.randn(rows, 40, generator=gen)
            assert torch.equal(routed(x), routed.route(rows)(x)), rows
    assert routed.rows_cap < 20    # (so that 20 and 40 rows share the entry of rows_cap)
    assert sorted(routed._by_rows) == sorted({min(rows, routed.rows_cap) for rows in counts})


def test_packed_gemm_gives_torch_linear_at_every_row_count():
    from ops import linear
    if not linear.has_packed_gemm():
        pytest.skip("this torch has no MKL")
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 72, generator=gen), torch.randn(96, generator=gen)
    for with_bias in (False, True):
        routed = linear.RoutedLinear(weight, bias if with_bias else None, None, packed=True)
        for rows in (1, 2, 7, 17, 64, 65, 300):
            x = torch.randn(rows, 72, generator=gen)
            torch.testing.assert_close(routed(x), torch.nn.functional.linear(x, weight, bias if with_bias else None),
                                       atol=1e-4, rtol=1e-5)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    import os
    import time

    import torch.utils.cpp_extension as ext
    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_kernels._remove_stale_lock()
    assert lock.exists()                       # another process may be building right now
    old = time.time() - cpu_kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    cpu_kernels._remove_stale_lock()
    assert not lock.exists()


def test_a_build_for_another_cpu_has_a_name_and_a_march_of_its_own(monkeypatch):
    import torch.utils.cpp_extension as ext

    from tests.helpers import cpu_flags
    flags_of = {}
    monkeypatch.setattr(ext, "load", lambda name, sources, extra_cflags, **kw: flags_of.setdefault(name, extra_cflags))
    digests = {}
    for march in ("native", "x86-64-v3", ""):
        monkeypatch.setattr(cpu_kernels, "MARCH", march)
        digests[march] = cpu_kernels._sources_digest()
        cpu_kernels.build(march or "none", [])
    assert len(set(digests.values())) == 3   # neither build takes the other's place in torch's cache
    assert "-march=native" in flags_of["native"] and "-march=x86-64-v3" in flags_of["x86-64-v3"]
    assert not any(f.startswith("-march") for f in flags_of["none"])
    # the tests then judge a build by the flags of the CPU it was made for, not by this one's
    monkeypatch.setattr(cpu_kernels, "MARCH", "x86-64-v3")
    assert {"avx2", "fma", "f16c"} <= cpu_flags() and not cpu_flags() & {"avx512f", "avx512_bf16", "amx_tile"}


def test_backend_names_the_reason_off_the_cpu(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TRITON", "0")
    assert attention.choose(torch.device("cuda"), torch.float32).describe() == \
        "torch reference (Triton turned off by PAGEDSERVE_TRITON=0)"


def test_a_model_with_no_eligible_layer_routes_nothing_and_builds_nothing(monkeypatch):
    from ops import linear
    monkeypatch.setattr(cpu_kernels, "load", lambda: pytest.fail("the kernel must not be loaded"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=True), torch.nn.Linear(8, 4).to(torch.bfloat16))
    assert linear.route_linears(model, packed=False) == {"codes": 0, "panels": 0, "kernel": 0, "packed": 0, "dots": 0}


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_fused_layer_ops_match_torch_operations(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    hidden, heads, kv_heads, dim = 40, 5, 1, 8                   # 40 = two lanes of 16 plus a tail of 8
    residual, x, w = (torch.randn(rows, hidden, generator=gen) for _ in range(3))
    w = w[0].contiguous()
    expected_residual = residual + x
    variance = expected_residual.pow(2).mean(-1, keepdim=True)
    expected = w * (expected_residual * torch.rsqrt(variance + 1e-6))
    got = kernel.add_rms_norm(residual, x, w, 1e-6)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)   # the add is in place
    assert torch.equal(got, expected)   # the sum of squares in torch's order: its bits
    assert torch.equal(kernel.add_rms_norm(residual, None, w, 1e-6), w * (residual * torch.rsqrt(
        residual.pow(2).mean(-1, keepdim=True) + 1e-6)))

    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    cos, sin = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)

    def rotate(t):
        half = dim // 2
        return t * cos[:, None] + torch.cat((-t[..., half:], t[..., :half]), -1) * sin[:, None]
    q_out, k_out = kernel.rotary(q, k, cos, sin)
    assert torch.equal(q_out, rotate(q)) and torch.equal(k_out, rotate(k))   # the same operations, unfused

    gate_up = torch.randn(rows, 2 * 24, generator=gen)
    gate_up[0, :4] = torch.tensor([-100.0, -88.5, 90.0, 0.0])    # e^-gate past float's range, both ways
    torch.testing.assert_close(kernel.silu_mul(gate_up),
                               torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [40, 576, 8200])   # a tail of 8; SmolLM2's; the sum's second level
def test_rms_norm_is_transformers_bit_for_bit(kernel, dtype, hidden):
    # the sum of squares adds in torch's order (its reduction's vectors, accumulators and levels): an
    # order of its own differed from transformers' in 30% of float32 outputs and 1 in 10,000 bfloat16 ones
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(hidden)
    residual = (3 * torch.randn(64, hidden, generator=gen)).to(dtype)
    x = torch.randn(64, hidden, generator=gen).to(dtype)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    with torch.no_grad():
        expected = norm(residual + x)
        assert torch.equal(kernel.add_rms_norm(residual, x, norm.weight.detach(), 1e-5), expected)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_bfloat16_fused_ops_round_where_transformers_rounds(kernel, rows):
    # transformers' own bfloat16 modules as the reference: LlamaRMSNorm, apply_rotary_pos_emb, SiLU * up
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(rows)
    hidden, heads, kv_heads, dim = 40, 5, 1, 8
    residual, x = (torch.randn(rows, hidden, generator=gen).to(bf16) for _ in range(2))
    norm = LlamaRMSNorm(hidden, eps=1e-6).to(bf16)
    norm.weight.data = torch.randn(hidden, generator=gen).to(bf16)
    expected_residual = residual + x
    with torch.no_grad():
        expected = norm(expected_residual)
        got = kernel.add_rms_norm(residual, x, norm.weight.detach(), 1e-6)
    assert torch.equal(residual, expected_residual)                  # the add in place, rounded alike
    assert torch.equal(got, expected)

    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(bf16)
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    cos, sin = torch.randn(rows, dim, generator=gen).to(bf16), torch.randn(rows, dim, generator=gen).to(bf16)
    # transformers' layout: [batch, heads, tokens, dim], cos/sin [batch, tokens, dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    q_out, k_out = kernel.rotary(q, k, cos, sin)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1)) and torch.equal(k_out, k_ref[0].transpose(0, 1))

    gate_up = torch.randn(rows, 2 * 40, generator=gen).to(bf16)    # two lanes of 16 plus a tail
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    got = kernel.silu_mul(gate_up)
    assert got.dtype == bf16
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-3, rtol=2 ** -7)
    assert (got == expected).float().mean() > 0.97


@pytest.mark.parametrize("vocab", [1, 37, 49152])
def test_greedy_logsumexp_is_torchs_max_first_index_and_logsumexp(kernel, vocab):
    from data_plane.sampler import greedy_logsumexp
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 8
    logits[1, vocab // 2 + 1:] = float("-inf")                # masked tokens (structured output)
    logits[2, vocab - 1] = logits[2, vocab // 3] = logits[2].max() + 1   # a tie: the first index wins
    best, index, lse = kernel.greedy_logsumexp(logits)
    want_best, want_index = logits.max(dim=-1)
    assert torch.equal(best, want_best) and torch.equal(index, want_index)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)
    # a row with a NaN, or with no finite logit, is left to torch's ops (NaN and -inf as torch has them)
    logits[3, 0] = float("nan")
    logits[4] = float("-inf")
    got = greedy_logsumexp(logits)
    want = (*logits.max(dim=-1), torch.logsumexp(logits, dim=-1))
    for a, b in zip(got, want):
        assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True)


@pytest.mark.parametrize("vocab", [1, 37, 49152])
def test_greedy_logsumexp_of_bfloat16_logits_is_that_of_their_float32_copy(kernel, vocab):
    # the sampler hands plain greedy rows' bfloat16 logits over as they are: every result must be the one
    # their float32 widening gives, bit for bit (ties, masked tokens, and the rows left to torch included)
    from data_plane.sampler import greedy_logsumexp
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 8).to(torch.bfloat16)
    logits[1, vocab // 2 + 1:] = float("-inf")
    logits[2, vocab - 1] = logits[2, vocab // 3] = logits[2].max() + 1   # a tie: the first index wins
    logits[5, -1] = logits[5].max() + 1                                   # the max in the tail past 16s
    for got, want in zip(kernel.greedy_logsumexp(logits), kernel.greedy_logsumexp(logits.float())):
        assert got.dtype == want.dtype and torch.equal(got, want)
    logits[3, 0] = float("nan")
    logits[4] = float("-inf")
    for got, want in zip(greedy_logsumexp(logits), greedy_logsumexp(logits.float())):
        assert got.dtype == want.dtype and (torch.equal(got, want) or torch.allclose(got, want, equal_nan=True))
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        kernel.greedy_logsumexp(logits.half())


def test_fused_layer_ops_refuse_what_they_cannot_compute(kernel):
    with pytest.raises(RuntimeError, match="residual must be contiguous float32 or bfloat16"):
        kernel.add_rms_norm(torch.randn(4, 8, dtype=torch.float64), None, torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\] of the residual's type"):
        kernel.add_rms_norm(torch.randn(4, 8), None, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel.rotary(torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="gate_up must be contiguous"):
        kernel.silu_mul(torch.randn(3, 7))


def test_write_kv_kernel_stores_rows_at_their_slots_and_skips_padding(kernel):
    from ops import reference
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 * 8, generator=gen)            # k and v are strided views, as the lean forward's are
    k, v = qkv[:, :16].view(5, 2, 8), qkv[:, 16:].view(5, 2, 8)
    slots = torch.tensor([7, -1, 0, 12, 3])
    caches = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    kernel.write_kv(k, v, caches[0], caches[1], slots)
    reference.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot 16 out of range"):
        kernel.write_kv(k, v, caches[0], caches[1], torch.tensor([7, -1, 0, 16, 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_is_rotary_then_write_kv_bit_for_bit(kernel, dtype):
    """The lean forward's one call per layer gives q as `rotary` does and the caches as `rotary` then
    `write_kv` do, on a qkv row stride wider than its heads (the stacked product's output sliced)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 3, 1, 8, 6
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width + 4, generator=gen).to(dtype)[:, :width]
    cos, sin = torch.randn(tokens, dim, generator=gen).to(dtype), torch.randn(tokens, dim, generator=gen).to(dtype)
    slots = torch.tensor([7, -1, 0, 12, 3, 15])
    q_want, k_want = kernel.rotary(qkv[:, :heads * dim].view(tokens, heads, dim),
                                   qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    caches = [torch.zeros(4, 4, kv_heads, dim, dtype=dtype) for _ in range(4)]
    kernel.write_kv(k_want, v, caches[0], caches[1], slots)
    q = kernel.rotary_store(qkv, heads, kv_heads, cos, sin, caches[2], caches[3], slots)
    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    assert torch.equal(q.view(torch.int16) if dtype == torch.bfloat16 else q,
                       q_want.view(torch.int16) if dtype == torch.bfloat16 else q_want)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].abs().sum() > 0 and caches[3].abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot 16 out of range"):
        kernel.rotary_store(qkv, heads, kv_heads, cos, sin, caches[2], caches[3], torch.tensor([7, -1, 0, 16, 3, 1]))
    with pytest.raises(RuntimeError, match="width"):
        kernel.rotary_store(qkv, heads + 1, kv_heads, cos, sin, caches[2], caches[3], slots)
