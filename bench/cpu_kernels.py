"""The CPU kernels (pagedserve_kernels/cpu/) side by side with the torch ops they replace, in one run.

    python bench/cpu_kernels.py            # SmolLM2-135M's shapes, 2 threads
    python bench/cpu_kernels.py --quick    # CI-sized

decode attention  the C++ kernel reading K/V from the blocks, against the torch reference
                  (padded index_select gather of whole blocks + SDPA), one layer of SmolLM2
                  (9 query heads, 3 KV heads, head_dim 64) for a batch of decode rows;
few-row linear    the kernel against torch's GEMM (F.linear) over every linear layer of one
                  SmolLM2 step (30 x q, k, v, o, gate, up, down, plus lm_head), for a few rows.
The two alternate repetition by repetition, so that a change in machine load hits both alike.
Outputs are compared too: the largest difference is printed next to each figure.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB, LAYERS = 9, 3, 64, 576, 1536, 49152, 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--batches", default="8,64,128", help="decode rows of the attention comparison")
    ap.add_argument("--contexts", default="100,400", help="context lengths of the attention comparison")
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,96", help="rows of the linear comparison")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="one small case of each, 2 repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.rows, args.reps = "4", "40", "2,16", 2
    for name in ("batches", "contexts", "rows"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    return args


def alternate(fa, fb, reps: int) -> tuple[float, float]:
    """Mean seconds of fa and fb, run alternately after one warm-up call each."""
    fa(), fb()
    ta = tb = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fa()
        ta += time.perf_counter() - t
        t = time.perf_counter()
        fb()
        tb += time.perf_counter() - t
    return ta / reps, tb / reps


def attention_rows(args, kernel):
    import torch
    from ops import attention, reference
    rng = random.Random(0)
    for batch in args.batches:
        for context in args.contexts:
            # contexts spread +-50% around the figure, blocks shuffled over a pool with spare blocks
            lens = [max(1, int(context * rng.uniform(0.5, 1.5))) for _ in range(batch)]
            need = [-(-n // args.block_size) for n in lens]
            pool = sum(need) + 8
            perm = torch.randperm(pool, generator=torch.Generator().manual_seed(batch + context)).tolist()
            tables = torch.zeros(batch, max(need), dtype=torch.int32)
            taken = 0
            for i, n in enumerate(need):
                tables[i, :n] = torch.tensor(perm[taken:taken + n], dtype=torch.int32)
                taken += n
            k = torch.randn(pool, args.block_size, KV_HEADS, HEAD_DIM)
            v = torch.randn(pool, args.block_size, KV_HEADS, HEAD_DIM)
            q = torch.randn(HEADS, batch, HEAD_DIM).transpose(0, 1)   # as the model hands it over
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            starts = torch.arange(batch + 1, dtype=torch.int32)
            call = (q, k, v, tables, seq_lens, starts, HEAD_DIM ** -0.5)

            def ref():
                return reference.paged_attention(*call, 1)

            def ker():
                return attention.paged_attention_cpu(kernel, *call)
            diff = (ref() - ker()).abs().max().item()
            t_ref, t_ker = alternate(ref, ker, args.reps)
            C.progress(f"attention {batch} x {context}")
            yield (f"{batch:>5}  {context:>7}  {1e3 * t_ref:>12.2f}  {1e3 * t_ker:>9.2f}  "
                   f"{t_ref / t_ker:>6.2f}x  {diff:.1e}")


def linear_rows(args, kernel):
    import torch
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN),
              (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]
    weights = [torch.randn(n, k, generator=gen) for _ in range(LAYERS) for n, k in shapes]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen))
    mib = sum(w.numel() for w in weights) * 4 / 2**20
    # MKL's GEMM on weights packed once (ops/linear.py), against F.linear in a second alternation
    packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, 64) for w in weights]
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, FFN)}

        def gemm():
            return [F.linear(inputs[w.shape[1]], w) for w in weights]

        def skinny():
            return [kernel.skinny_linear(inputs[w.shape[1]], w) for w in weights]

        def packed():
            return [torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, rows) for p, w in zip(packs, weights)]
        diff = max((a - b).abs().max().item() for a, b in zip(gemm(), skinny()))
        diff_packed = max((a - b).abs().max().item() for a, b in zip(gemm(), packed()))
        t_gemm, t_skinny = alternate(gemm, skinny, args.reps)
        t_gemm2, t_packed = alternate(gemm, packed, args.reps)
        C.progress(f"linear {rows} rows")
        yield (f"{rows:>4}  {1e3 * t_gemm:>13.1f}  {mib / 1024 / t_gemm:>9.1f}  {1e3 * t_skinny:>9.1f}  "
               f"{mib / 1024 / t_skinny:>11.1f}  {t_gemm / t_skinny:>6.2f}x  {diff:.1e}   "
               f"{1e3 * t_gemm2:>7.1f}  {1e3 * t_packed:>9.1f}  {t_gemm2 / t_packed:>6.2f}x  {diff_packed:.1e}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from ops import cpu_kernels
    torch.set_num_threads(args.num_threads)
    print(C.machine_line(args.num_threads))
    kernel = cpu_kernels.load()
    if kernel is None:
        print(f"the CPU kernels are not built: {cpu_kernels.failure()}", file=sys.stderr)
        return 1
    print(f"kernels: {kernel.__file__} (AVX2/FMA: {kernel.vectorized()}); {args.reps} alternating repetitions")
    print(f"\ndecode attention, one layer ({HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
          f"block {args.block_size}; contexts +-50% around the figure):")
    print("batch  context  reference ms  kernel ms  speedup  max |diff|")
    for line in attention_rows(args, kernel):
        print(line, flush=True)
    C.progress_done()
    print("\nevery linear layer of one SmolLM2 step (30 layers x 7 + lm_head), few rows:")
    print("rows  torch GEMM ms  GEMM GB/s  kernel ms  kernel GB/s  speedup  max |diff|   GEMM ms  packed ms  speedup  max |diff|")
    for line in linear_rows(args, kernel):
        print(line, flush=True)
    C.progress_done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
