"""How close the CPU kernel's bfloat16 attention is to transformers' (torch's SDPA on a CPU): in torch's SDPA
steps with the two products in MKL's order (the default where the start-up check of ops/sdpa_order.py
matches), in SDPA's steps with the products in the kernel's order, and all in the kernel's own order.

    python bench/bf16_attention.py [--contexts 5,20,100,300,600,1100] [--prompts 7,20,34,51,96] [--seeds 3]

Per decode context (one query over that many keys, SmolLM2's 9 query / 3 KV heads of 64) and per prompt
length (one row per prompt token, causal), over --seeds random cases: how many output values differ from
SDPA's, bit for bit, of how many; and the largest difference in bfloat16 steps in MKL's order.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import attention, sdpa_order  # noqa: E402

def compare(queries: int, keys: int, seed: int) -> tuple[int, int, int, int, float]:
    """Values that differ from SDPA's: products in MKL's order, in the kernel's (both in SDPA's steps), and
    all in the kernel's own order; the values; the largest difference in bfloat16 steps, in MKL's order."""
    args, sdpa = sdpa_order.sdpa_case(queries, keys, seed)
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    mkl, steps_only = (sdpa_order.kernel_attention(chosen.kernel, args, chosen.sdpa_lanes, m) for m in (True, False))
    plain = attention.paged_attention(*args, backend=attention.Backend("cpu", torch.bfloat16, False, chosen.kernel))
    ulp = torch.exp2(torch.floor(torch.log2(sdpa.float().abs().clamp_min(1e-30))) - 7)   # a bfloat16 step there
    steps = ((mkl.float() - sdpa.float()).abs() / ulp).max().item()
    return (*(int((out != sdpa).sum()) for out in (mkl, steps_only, plain)), sdpa.numel(), steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="5,20,100,300,600,1100")
    ap.add_argument("--prompts", default="7,20,34,51,96")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lanes = attention.torch_sdpa_lanes(torch.bfloat16)
    print(f"torch {torch.__version__}, CPU vectors {torch.backends.cpu.get_cpu_capability()}: SDPA order with "
          f"{lanes} lanes" if lanes else "SDPA order off here (torch's CPU vectors are neither AVX-512 nor AVX2)")
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    print(f"products in MKL's order: {'on (the start-up check matched)' if chosen.mkl_order else 'off (no match)'}")
    print(f"{'values differing:':<22} {'MKL order':>17} {'SDPA steps only':>16} {'own order':>10} {'of':>9} "
          f"{'max steps apart':>16}")
    cases = [("decode, context", 1, int(c)) for c in args.contexts.split(",")] + \
            [("prompt rows, length", int(p), int(p)) for p in args.prompts.split(",")]
    for name, queries, keys in cases:
        counts = [0, 0, 0, 0]
        steps = 0.0
        for seed in range(args.seeds):
            *found, worst = compare(queries, keys, seed=keys + 1000 * seed)
            counts = [a + b for a, b in zip(counts, found)]
            steps = max(steps, worst)
        print(f"{name + ' ' + str(keys):<22} {counts[0]:>17} {counts[1]:>16} {counts[2]:>10} {counts[3]:>9} "
              f"{steps:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
