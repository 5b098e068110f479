"""How close the CPU kernel's bfloat16 attention is to transformers' (torch's SDPA on a CPU), in torch's
SDPA order (the default where torch's CPU vectors are AVX-512 or AVX2) and in the kernel's own order.

    python bench/bf16_attention.py [--contexts 5,20,100,300,600,1100] [--prompts 20,51,96]

Per decode context (one query over that many keys, SmolLM2's 9 query / 3 KV heads of 64) and per prompt
length (one row per prompt token, causal): the fraction of output values equal to SDPA's, bit for bit,
and the largest difference in bfloat16 steps.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import attention  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def sdpa_case(queries: int, keys: int, seed: int) -> tuple[tuple, torch.Tensor]:
    """Random bfloat16 attention of `queries` query tokens (the last ones, causal) over `keys` keys in a paged
    pool: the arguments of ops.attention.paged_attention (before `backend`), and transformers' result for it
    (SDPA over the same keys, the KV heads repeated as transformers repeats them)."""
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
    group = HEADS // KV_HEADS
    sdpa = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(group, 0)[None],
        v.transpose(0, 1).repeat_interleave(group, 0)[None], scale=DIM ** -0.5,
        is_causal=queries > 1)[0].transpose(0, 1)
    return args, sdpa


def compare(queries: int, keys: int, seed: int) -> tuple[float, float, float]:
    args, sdpa = sdpa_case(queries, keys, seed)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    own = attention.Backend("cpu", torch.bfloat16, False, chosen.kernel, sdpa_lanes=0)
    ordered, plain = (attention.paged_attention(*args, backend=b) for b in (chosen, own))
    ulp = torch.exp2(torch.floor(torch.log2(sdpa.float().abs().clamp_min(1e-30))) - 7)   # a bfloat16 step there
    steps = ((ordered.float() - sdpa.float()).abs() / ulp).max().item()
    return (ordered == sdpa).float().mean().item(), (plain == sdpa).float().mean().item(), steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="5,20,100,300,600,1100")
    ap.add_argument("--prompts", default="20,51,96")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    print(f"torch {torch.__version__}, CPU vectors {torch.backends.cpu.get_cpu_capability()}: SDPA order with "
          f"{lanes} lanes" if lanes else "SDPA order off here (torch's CPU vectors are neither AVX-512 nor AVX2)")
    print(f"{'case':<22} {'equal, SDPA order':>18} {'equal, own order':>17} {'max steps apart':>16}")
    cases = [("decode, context", 1, int(c)) for c in args.contexts.split(",")] + \
            [("prompt rows, length", int(p), int(p)) for p in args.prompts.split(",")]
    for name, queries, keys in cases:
        ordered, plain, steps = compare(queries, keys, seed=keys)
        print(f"{name + ' ' + str(keys):<22} {ordered:>18.4f} {plain:>17.4f} {steps:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
