"""Whether the CPU kernel can give transformers' bfloat16 attention bit for bit by adding its two products
(q.k and the weighted values) in the order of the BLAS that torch's flash attention calls.

transformers' bfloat16 SDPA on a CPU runs torch's flash-attention kernel, which takes both products from
MKL's bfloat16 GEMM. The order in which that GEMM adds its float32 terms is MKL's own and depends on the CPU
(the kernel follows the one read from MKL's AVX2 path on an AMD AVX-512 CPU: pagedserve_kernels/cpu/paged_decode.cpp;
on an AVX2-only CPU some rows differ, the check says so, and the kernel keeps its own order there). With AMX tiles
MKL takes other orders, which the kernel also knows ("the tile order", `set_sdpa_tile_order`), and torch takes
a prompt's products of 64 tokens or more from oneDNN's brgemm instead (its packed path), whose groups of keys the
kernel follows too (paged_decode.cpp's sdpa_packs). Checked once per process, on random attention in a paged pool
against SDPA as transformers calls it (the KV heads as they are: enable_gqa): decode rows past one and two blocks
of 512 keys, and the rows of prompts whose calls take each shape of product."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16   # SmolLM2's attention

# (queries, keys): decode rows, and prompts whose query blocks are of one to three rows, of under twelve
# keys, and of 32 rows; prompts that torch packs, their keys summed in groups of 32 (96) and of 4 and 18 (67, 125),
# the last row of 97 alone in its block
CHECK_CASES = ((1, 5), (1, 150), (1, 600), (1, 1030), (7, 7), (34, 34), (35, 35), (51, 51), (96, 96), (67, 67),
               (125, 125), (97, 97))


def sdpa_case(queries: int, keys: int, seed: int) -> tuple[tuple, torch.Tensor]:
    """Random bfloat16 attention of `queries` query tokens (the last ones, causal) over `keys` keys in a paged
    pool: the arguments of ops.attention.paged_attention (before `backend`), and transformers' result for it
    (SDPA over the same keys, the KV heads as they are, as transformers passes them without a mask)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(keys, KV_HEADS, DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(queries, HEADS, DIM, generator=gen).to(torch.bfloat16)
    blocks = -(-keys // BLOCK)
    k_cache, v_cache = (torch.zeros(blocks * BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2))
    k_cache[:keys], v_cache[:keys] = k, v
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    args = (q, k_cache.view(shape), v_cache.view(shape), torch.arange(blocks, dtype=torch.int32)[None],
            torch.tensor([keys], dtype=torch.int32), torch.tensor([0, queries], dtype=torch.int32), DIM ** -0.5,
            queries)
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=DIM ** -0.5,
        is_causal=queries > 1, enable_gqa=True)[0].transpose(0, 1)
    return args, sdpa


def kernel_attention(kernel, args: tuple, lanes: int, mkl_order: bool) -> torch.Tensor:
    """The kernel's rows for a case of sdpa_case, in torch's SDPA steps (`lanes`), the products in MKL's
    order or in the kernel's own."""
    from ops.attention import kernel_rows
    query, k_cache, v_cache, tables, seq_lens, starts, scale, _ = args
    rows = kernel_rows(starts, seq_lens, tables)
    out = torch.empty_like(query)
    kernel.paged_decode(out, query, k_cache, v_cache, rows.tables, rows.lens, rows.tokens, float(scale), 0, 0.0,
                        None, None, 0, rows.ends, lanes, rows.qrows if mkl_order else None)
    return out


def prompt_runs(args: tuple, runs: tuple[int, ...], backend, max_query: int | None = None) -> list[tuple]:
    """A prompt of sdpa_case (queries == keys) handed to ops.attention.paged_attention in `runs` of its query
    tokens, as the runner hands a prompt split over steps (the prompt's length known): per run, its rows of the
    result and its KernelRows, made with `max_query` (None: the module's KERNEL_MAX_QUERY)."""
    from ops.attention import KERNEL_MAX_QUERY, kernel_rows, paged_attention
    query, k_cache, v_cache, tables, prompt_lens, _, scale, _ = args
    done, results = 0, []
    for run in runs:
        seq_lens = torch.tensor([done + run], dtype=torch.int32)
        starts = torch.tensor([0, run], dtype=torch.int32)
        rows = kernel_rows(starts, seq_lens, tables, max_query or KERNEL_MAX_QUERY, prompt_lens=prompt_lens,
                           chunks=backend.prompt_chunks)
        results.append((paged_attention(query[done:done + run].contiguous(), k_cache, v_cache, tables, seq_lens, starts,
                                        scale, run, kernel_rows=rows, backend=backend), rows))
        done += run
    return results


# Random inputs per case: where the orders differ, a case shows it on some inputs only (on an AVX2-only
# CPU a few of 8 seeds differ in one to thirty values), so one seed per case can pass by luck. The
# tests draw seed keys + 1, outside these.
CHECK_SEEDS = (0, 2, 3, 4)


@functools.cache
def mkl_order_matches(kernel, lanes: int) -> bool:
    """True when the kernel's rows with the products in MKL's order equal SDPA's on every check case, in one
    of the orders the kernel knows: MKL's AVX2 path's, or its AMX tiles' (`set_sdpa_tile_order`), which stays
    set when it is the one that matches."""
    for tiles in (False, True):
        kernel.set_sdpa_tile_order(tiles)
        if all(torch.equal(kernel_attention(kernel, args, lanes, True), expected)
               for args, expected in (sdpa_case(queries, keys, seed=keys + offset)
                                      for queries, keys in CHECK_CASES for offset in CHECK_SEEDS)):
            return True
    kernel.set_sdpa_tile_order(False)
    return False
