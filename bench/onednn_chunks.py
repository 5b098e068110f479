"""How oneDNN's bfloat16 GEMM (`F.linear`) sums a call on AMX tiles, by its row count, on SmolLM2's product shapes.

    python bench/onednn_chunks.py                 # every shape, row counts 1-600
    python bench/onednn_chunks.py --max-rows 128

Per shape (outputs x inputs), two things:
1. rows apart: of a call of M rows, how many rows differ from the same rows each in a call of its own (a
   generated token is such a call in transformers); none up to TILE_CALL_ROWS where oneDNN sums in one accumulator;
2. the chunks: for each run of row counts, the chunks of inputs (ops/linear.onednn_chunk's candidates) in which
   the kernel's tile product (`amx_linear`) gives the call's bits on every output of random rows whose second half
   of inputs nearly cancels the first; NONE where no chunk does (those calls take `F.linear` itself in the
   runner). A chunk of all the inputs, or of 32, is the one accumulator's order.
Needs a CPU with AMX tiles and the kernels built for it.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# SmolLM2-135M's products as transformers calls them: q and o, k and v, gate and up, down; and the output layer
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-rows", type=int, default=600)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from ops import cpu_kernels, linear
    kernel = cpu_kernels.load()
    if kernel is None or not kernel.has_amx_linear():
        print("no AMX tiles here (or no kernels): nothing to read")
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; oneDNN sums calls of up to "
          f"{linear.TILE_CALL_ROWS} rows in one accumulator: {linear.onednn_tile_order(kernel)}")
    counts = sorted({*range(1, min(args.max_rows, 130) + 1), *range(130, args.max_rows + 1, 7), args.max_rows})
    for outputs, inputs in SHAPES:
        gen = torch.Generator().manual_seed(outputs + inputs)
        w = (torch.randn(outputs, inputs, generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(min(args.max_rows, 512), inputs, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            alone = torch.cat([F.linear(x[r:r + 1], w) for r in range(x.shape[0])])
            apart = {m: int((F.linear(x[:m], w) != alone[:m]).any(1).sum())
                     for m in (8, 32, 33, 64, 128, 256, 512) if m <= x.shape[0]}
        print(f"\n{outputs} x {inputs}: rows apart from their one-row calls, by the call's rows: "
              + ", ".join(f"{m}: {n}" for m, n in apart.items()))
        candidates = [c for c in range(32, inputs + 1, 32) if inputs % c == 0]
        xs, ws, tiles = linear.probe_data(kernel, args.max_rows, outputs, inputs)
        runs = []
        for m in counts:
            with torch.no_grad():
                theirs = F.linear(xs[:m], ws)
            chunks = tuple(c for c in candidates if torch.equal(kernel.amx_linear(xs[:m], tiles, c), theirs))
            if runs and runs[-1][2] == chunks:
                runs[-1][1] = m
            else:
                runs.append([m, m, chunks])
        print("  chunks that give the call's bits, by its rows: "
              + "; ".join(f"{a}-{b}: {','.join(map(str, c)) or 'NONE'}" for a, b, c in runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
