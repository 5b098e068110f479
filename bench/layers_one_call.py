"""The layers in one call (CodedLayers, pagedserve_kernels/cpu/coded_layers.cpp) against the lean forward's
Python loop over the same kernels: decode steps of a few rows on SmolLM2 in this process (the data plane's
ModelRunner, no ZeroMQ), the two ways alternating every --block steps, at a context of 128.

    python bench/layers_one_call.py                          # bfloat16, rows 1, 2, 4
    python bench/layers_one_call.py --dtype float32 --rows 1,8
    python bench/layers_one_call.py --avx2-routes --rows 1,2,5   # bfloat16 as a CPU with AVX2 alone routes it

--avx2-routes: the bfloat16 products take the routes of a CPU whose oneDNN has no bfloat16 GEMM (the
order of torch's own GEMM, bf16_dots_codes_linear), on any CPU with AVX2. Prints per row count the
median step of each way and the median over rounds of the loop's step less the one call's.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import types

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402
from overhead import RunnerSteps  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=20, help="steps of one way before the other")
    ap.add_argument("--avx2-routes", action="store_true")
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.avx2_routes:
        from ops import linear
        linear.has_packed_bf16_gemm = lambda: False
    print(C.machine_line(args.num_threads))
    rows = [int(r) for r in args.rows.split(",")]
    model = C.load_hf_model(args.num_threads)
    steps = types.SimpleNamespace(context=128, warmup=5, steps=args.rounds * 2 * args.block + 5, batches=rows,
                                  prefill=16)
    runner = RunnerSteps(model, steps, dtype=args.dtype)
    lean = runner.runner.lean
    layers = lean.coded_layers
    if layers is None:
        print("not run: the lean forward has no layers in one call here (not every product reads codes)")
        return 1
    print(f"{args.dtype}{' (AVX2 routes)' if args.avx2_routes else ''}: the one call takes up to "
          f"{lean.coded_rows if lean.coded_rows < sys.maxsize else 'any number of'} rows")
    table = C.Table(["rows", "one call ms", "Python loop ms", "loop - one call ms", "loop slower in"])
    for count in rows:
        if count > lean.coded_rows:
            table.add(count, "", "", "not run: more rows than the one call takes", "")
            continue
        C.progress(f"{count} rows")
        step = runner.steps(random.Random(count), "decode", count)
        for _ in range(5):
            step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for one_call in (True, False):
                lean.coded_layers = layers if one_call else None
                times[one_call].append(statistics.median(step()["execute"] for _ in range(args.block)) * 1e3)
        lean.coded_layers = layers
        diffs = [loop - one for one, loop in zip(times[True], times[False])]
        table.add(count, f"{statistics.median(times[True]):.3f}", f"{statistics.median(times[False]):.3f}",
                  f"{statistics.median(diffs):.3f}", f"{sum(d > 0 for d in diffs)}/{args.rounds}")
    C.progress_done()
    print(table.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
