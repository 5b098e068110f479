"""The data plane's decode step down each forward path, side by side in one process.

    python bench/forward_paths.py                       # batches 1,2,4,8,16,32,64 at a context of 128
    python bench/forward_paths.py --batches 8,64 --reps 6

Paths: `torch` (transformers' forward, F.linear everywhere), `routed` (transformers' forward, float32
linear layers routed by row count: the few-row kernel, then MKL's prepacked GEMM), `lean-ops` (the
lean forward, data_plane/llama_forward.py, with torch's operations for norm, rotary and SiLU and the
float32 routes), `lean-f32` (the lean forward with its fused CPU kernels, float32 routes: the default
before the codes kernel), `lean` (the default: the lean forward reading weights that are exactly
GGUF codes expanded as codes, pagedserve_kernels/cpu/coded_linear.cpp). For each batch the paths' steps alternate, so drift in
the machine's speed hits all of them alike.
Prints the median ms per step and each route's speed-up over `torch`. Whether the routes keep
the tokens identical is the tests' job (tests/kernels/test_cpu_kernel.py, the runner's oracle tests).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from overhead import RunnerSteps  # noqa: E402

# how transformers' forward routes its linear layers (the lean forwards route their own; of the
# model's layers they use only the output layer)
ROUTES = {"torch": dict(skinny_max_rows=0, packed=False, codes=False), "routed": dict(codes=False),
          "lean-ops": dict(codes=False), "lean-f32": dict(codes=False), "lean": dict(codes=False)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per route and batch")
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args(argv)
    from data_plane import llama_forward
    from ops import linear
    batches = [int(b) for b in args.batches.split(",")]
    print(C.machine_line(args.num_threads))
    model = C.load_hf_model(args.num_threads, device="cpu")
    ns = argparse.Namespace(batches=batches, context=args.context, prefill=0, steps=args.reps * len(ROUTES) + 2,
                            warmup=2)
    runner = RunnerSteps(model, ns)
    lean = runner.runner.lean
    if lean is not None:   # with float32 routes, and with torch's operations in place of the fused kernels
        lean_f32 = llama_forward.LlamaForward(model, codes=False)
        lean_ops = llama_forward.LlamaForward(model, codes=False)
        lean_ops.ops = llama_forward._TorchOps(lean.ops.act)
        leans = {"lean": lean, "lean-f32": lean_f32, "lean-ops": lean_ops}
    else:
        print("the lean forward does not apply here; its columns repeat `routed`")
    print(f"\ndecode step, context {args.context}, {args.reps} alternating steps per route, median ms per step")
    print("batch  " + "  ".join(f"{r:>9}" for r in ROUTES) + "  " + "  ".join(f"{r}/torch" for r in ROUTES if r != "torch"))
    for batch in batches:
        step = runner.steps(random.Random(batch), f"decode {batch}", batch)
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        for rep in range(args.reps + 1):
            for route, kw in ROUTES.items():
                linear.route_linears(model, **kw)
                runner.runner.lean = leans.get(route) if lean is not None else None
                t = time.perf_counter()
                step()
                if rep:                 # the first round warms every route up
                    times[route].append(time.perf_counter() - t)
        ms = {r: 1e3 * statistics.median(t) for r, t in times.items()}
        print(f"{batch:>5}  " + "  ".join(f"{ms[r]:>9.1f}" for r in ROUTES) + "  "
              + "  ".join(f"{ms['torch'] / ms[r]:>10.2f}x" for r in ROUTES if r != "torch"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
