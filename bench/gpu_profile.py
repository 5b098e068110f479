"""Where GPU time goes (CUDA only): attention kernels call by call, and the runner's decode step.

    python bench/gpu_profile.py [kernels|engine|all]

kernels: for decode and prefill shapes (bf16, 32/8 heads, head_dim 128, block 16, as
  bench/paged_kernels.py), the paged Triton kernels and SDPA over contiguous K/V timed four ways:
  one call between two events (what bench/paged_kernels.py reports), back to back (GPU time per
  call, and the CPU time per launch: when the two are equal the GPU waits for the launches),
  and replayed from a CUDA graph (GPU time without launch cost); then the prefill kernel's tile
  settings (query rows, keys, warps, stages) ranked by back-to-back time, with their error.
engine: ModelRunner decode steps of 1-256 sequences at context 128 on a random model shaped like
  SmolLM2-135M (float32), split into prepare, forward (CPU launch time and GPU time) and
  lm_head + sampling, next to transformers' own forward over a DynamicCache; then the kernels
  of two decode-128 steps from torch's profiler.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import overhead  # noqa: E402  (bench/ is on sys.path when run as a script)
import paged_kernels  # noqa: E402

from pagedserve_kernels import paged_prefill  # noqa: E402

PREFILL_TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2),
                 (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 2), (32, 64, 4, 2), (16, 64, 4, 2)]
SHAPES = [("decode", 1, 128), ("decode", 8, 1024), ("decode", 64, 1024), ("decode", 256, 1024),
          ("prefill", 1, 128), ("prefill", 8, 128), ("prefill", 64, 128), ("prefill", 8, 1024),
          ("prefill", 64, 1024), ("prefill", 1, 8192), ("prefill", 8, 8192)]


def back_to_back_ms(fn, n=50):
    """(GPU ms per call, CPU ms per launch) over n calls in a row."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    cpu = (time.perf_counter() - t) / n * 1e3
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n, cpu


def graph_ms(fn, n=50):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return back_to_back_ms(graph.replay, n)[0]


def profile_kernels():
    args = paged_kernels.parse_args([])
    device = torch.device("cuda")
    print("== attention, bf16 32/8 heads d128 block 16; ms: one call between events, back-to-back GPU per call, "
          "CPU per launch, CUDA-graph replay", flush=True)
    for kind, batch, ctx in SHAPES:
        s = paged_kernels.Setup(args, batch, ctx, 1 if kind == "decode" else ctx, device)
        for name, fn in (("paged", s.paged), ("sdpa", s.contiguous)):
            gpu, cpu = back_to_back_ms(fn)
            print(f"{kind:8}{batch:>5}{ctx:>6} {name:6} single {paged_kernels.cuda_ms(fn, 5, 20):7.3f}  b2b gpu {gpu:7.3f}  "
                  f"cpu/launch {cpu:6.3f}  graph {graph_ms(fn):7.3f}", flush=True)
        if kind == "prefill":
            base, ranked = paged_prefill.TILE[torch.bfloat16], []
            try:
                for tile in PREFILL_TILES:
                    paged_prefill.TILE[torch.bfloat16] = tile
                    err = (s.paged().float() - s.contiguous().transpose(1, 2).reshape_as(s.query).float()).abs().max()
                    ranked.append((back_to_back_ms(s.paged, 20)[0], tile, err.item()))
            finally:
                paged_prefill.TILE[torch.bfloat16] = base
            print("    tiles (rows, keys, warps, stages), b2b GPU ms [max error]: " + ", ".join(
                f"{t}={ms:.3f} [{e:.0e}]" for ms, t, e in sorted(ranked)), flush=True)
        del s
        torch.cuda.empty_cache()


def profile_engine():
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, DynamicCache, LlamaForCausalLM

    from data_plane import attention
    from shared.config import default_model_path, split_model_path
    folder, gguf = split_model_path(default_model_path())
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=gguf)).eval().cuda()
    model.set_attn_implementation(attention.register())
    ns = argparse.Namespace(context=128, warmup=3, steps=10, batches=[1, 8, 64, 128, 256], prefill=512, seed=0)
    runner = overhead.RunnerSteps(model, ns, device="cuda")   # random weights: SmolLM2's shapes only
    events = {}

    def mark(key):
        events[key] = torch.cuda.Event(enable_timing=True)
        events[key].record()
    # events around the runner's own forward (the lean forward or a graph replay never calls the
    # transformers module, so hooks on it would not fire)
    inner_forward = runner.runner._forward

    def forward_between_events(*a):
        mark("start")
        out = inner_forward(*a)
        mark("end")
        return out
    runner.runner._forward = forward_between_events
    rng = random.Random(0)
    print("== ModelRunner decode steps, random SmolLM2-shaped model, float32, ctx 128, ms per step (median of 10)")
    print("batch  execute  prepare(cpu)  forward(cpu launch)  forward(gpu)  lm_head+sample  | bare HF fwd+argmax "
          "(DynamicCache, synced)", flush=True)
    for b in ns.batches:
        step = runner.steps(rng, "decode", b)
        rows = []
        for _ in range(ns.warmup + ns.steps):
            p = step()
            torch.cuda.synchronize()
            rows.append((1e3 * p["execute"], 1e3 * p["prepare"], 1e3 * p["forward"],
                         events["start"].elapsed_time(events["end"]), 1e3 * p["lm_head+sample"]))
        med = [statistics.median(r[i] for r in rows[ns.warmup:]) for i in range(5)]
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            ids = torch.randint(0, model.config.vocab_size, (b, ns.context), device="cuda")
            nxt = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
            bare = []
            for _ in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                nxt = model(input_ids=nxt[:, None], cache=cache).logits[:, -1].argmax(-1)
                torch.cuda.synchronize()
                bare.append(1e3 * (time.perf_counter() - t))
        model.set_attn_implementation(attention.ATTENTION_NAME)
        print(f"{b:5} {med[0]:8.2f} {med[1]:12.2f} {med[2]:18.2f} {med[3]:13.2f} {med[4]:14.2f}   | "
              f"{statistics.median(bare[2:]):8.2f}", flush=True)
    step = runner.steps(rng, "decode", 128)
    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"GPU kernels in 2 decode-128 steps: {len(kernels)}, their time {sum(e.device_time for e in kernels) / 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="all", choices=["kernels", "engine", "all"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_profile.py needs CUDA; on CPU use bench/overhead.py and bench/cpu_kernels.py", file=sys.stderr)
        return 2
    failed = False
    for name, part in (("kernels", profile_kernels), ("engine", profile_engine)):
        if args.part in (name, "all"):
            try:
                part()
            except Exception:   # one part failing must not hide the other's figures
                traceback.print_exc()
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
