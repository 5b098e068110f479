"""Where a CPU decode step's time goes: torch profiler over the data plane's ModelRunner.

    python bench/cpu_profile.py                  # decode 64 sequences at a context of 128
    python bench/cpu_profile.py --batch 8 --steps 5

The runner runs in this process on SmolLM2-135M-Instruct (float32, or --dtype bfloat16), without ZeroMQ or the control
plane (bench/overhead.py measures those). Prints the step time split into input preparation,
forward and lm_head + sampling, then the operators by self CPU time, grouped into matmul,
attention, elementwise/norm and the rest.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from overhead import RunnerSteps  # noqa: E402

GROUPS = {   # operator name fragments -> group; the first match wins
    "matmul (linear, lm_head)": ("addmm", "mm", "linear", "matmul", "skinny"),
    "attention (paged)": ("paged", "attention", "write_kv", "index_put", "gather"),
    "norm, rotary, activation, residual": ("mul", "add", "pow", "mean", "rsqrt", "silu", "cat", "neg", "cos", "sin",
                                           "embedding", "div", "sub"),
}


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, fragments in GROUPS.items():
        if any(f in lowered for f in fragments):
            return group
    return "other (copies, views, sampling, python)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile
    print(C.machine_line(args.num_threads))
    print(C.cpu_check(args.num_threads))
    model = C.load_hf_model(args.num_threads, device="cpu")   # the runner narrows it to --dtype
    ns = argparse.Namespace(batches=[args.batch], context=args.context, prefill=0, steps=args.steps, warmup=2)
    runner = RunnerSteps(model, ns, dtype=args.dtype)
    step = runner.steps(random.Random(0), f"decode {args.batch}", args.batch)
    for _ in range(2):
        step()
    parts = defaultdict(float)
    started = time.perf_counter()
    for _ in range(args.steps):
        for key, value in step().items():
            parts[key] += value
    wall = (time.perf_counter() - started) / args.steps
    print(f"\ndecode {args.batch} x ctx {args.context}: {1000 * wall:.1f} ms per step "
          f"({args.batch / wall:.0f} tok/s); parts, ms: "
          + ", ".join(f"{k} {1000 * v / args.steps:.1f}" for k, v in parts.items()))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    grouped = defaultdict(float)
    for e in events:
        grouped[group_of(e.key)] += e.self_cpu_time_total
    print(f"\nself CPU time by group (profiled steps, {total / 1000 / args.steps:.1f} ms per step incl. profiler cost)")
    for group, t in sorted(grouped.items(), key=lambda kv: -kv[1]):
        print(f"  {group:<40} {t / 1000 / args.steps:8.1f} ms  {100 * t / total:5.1f}%")
    print()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
