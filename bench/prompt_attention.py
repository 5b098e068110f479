"""Where prompt runs should leave the CPU kernel (ops/attention.KERNEL_MAX_QUERY): one prompt of N tokens,
one layer of SmolLM2's attention (9 query heads, 3 KV heads, head_dim 64, blocks shuffled), through the C++
kernel (one row per query token) and through the torch reference (SDPA over the gathered context), in float32
and bfloat16; and whether the kernel's bfloat16 rows have the bits of transformers' one SDPA call over the
prompt (ops/sdpa_order.sdpa_case), the prompt whole and in two runs.

    python bench/prompt_attention.py                      # prompts of 96, 128, 160, 192, 193, 256 tokens
    python bench/prompt_attention.py --lengths 200,300
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def timings(n: int, dtype, repeats: int) -> tuple[float, float]:
    """Median ms of the kernel and of the reference for one n-token prompt, alternating."""
    import torch
    from ops import attention, reference
    chosen = attention.choose(torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(n)
    blocks = -(-n // BLOCK)
    k_cache, v_cache = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(n, HEADS, DIM, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    lens, starts = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    rows = attention.kernel_rows(starts, lens, tables, max_query=n, prompt_lens=lens)
    runs = {
        "kernel": lambda: attention.paged_attention_cpu(chosen.kernel, query, k_cache, v_cache, tables, lens, starts,
                                                        DIM ** -0.5, work=rows, lanes=chosen.sdpa_lanes,
                                                        mkl_order=chosen.mkl_order),
        "reference": lambda: reference.paged_attention(query, k_cache, v_cache, tables, lens, starts, DIM ** -0.5, n),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return statistics.median(times["kernel"]) * 1e3, statistics.median(times["reference"]) * 1e3


def transformers_bits(n: int) -> str:
    """Whether the kernel's bfloat16 rows equal transformers' SDPA over the n-token prompt: whole, and as two
    runs (the first half, then the rest) as the runner hands a prompt split over two steps."""
    import torch
    from ops import attention, sdpa_order
    chosen = attention.choose(torch.device("cpu"), torch.bfloat16)
    if not chosen.sdpa_lanes or not chosen.mkl_order:
        return "not checked (the kernel does not follow torch's SDPA order on this CPU)"
    args, expected = sdpa_order.sdpa_case(n, n, seed=n)
    verdicts = []
    for runs in ((n,), (n // 2, n - n // 2)):
        got = torch.cat([out for out, _ in sdpa_order.prompt_runs(args, runs, chosen, max_query=n)])
        verdicts.append(f"{'whole' if len(runs) == 1 else 'two runs'} {int((got == expected).sum())}/{got.numel()}")
    return ", ".join(verdicts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="96,128,160,192,193,256")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.num_threads)
    from ops import attention, cpu_kernels
    if cpu_kernels.load() is None:
        print(f"not run: no CPU kernels ({cpu_kernels.failure() or 'PAGEDSERVE_CPU_KERNELS=0'})")
        return 1
    print(C.machine_line(args.num_threads))
    table = C.Table(["prompt", "dtype", "kernel ms", "reference ms", "kernel/reference",
                     "bfloat16 values equal to transformers' SDPA"])
    for n in [int(x) for x in args.lengths.split(",")]:
        for dtype in (torch.float32, torch.bfloat16):
            kernel_ms, reference_ms = timings(n, dtype, args.repeats)
            bits = transformers_bits(n) if dtype == torch.bfloat16 else ""
            table.add(n, str(dtype)[6:], f"{kernel_ms:.3f}", f"{reference_ms:.3f}", f"{kernel_ms / reference_ms:.2f}", bits)
    print(f"one layer, median of {args.repeats}; the kernel serves prompt runs of up to "
          f"{attention.KERNEL_MAX_QUERY} tokens")
    print(table.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
