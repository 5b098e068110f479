"""Paged attention kernels against contiguous-KV attention (torch SDPA).

    python bench/paged_kernels.py [--quick] [--peak-gbps 4800] [--dtype bf16] [--heads 32 --kv-heads 8 ...]

On CUDA: for a grid of batch x context, times the Triton paged decode (one query token per
sequence) and paged prefill (q_len = context, causal) against SDPA over contiguous K/V holding the
same data, and prints time, achieved bandwidth (bytes of K/V read + q and out written, per call),
the share of the assumed peak bandwidth, and the paged/contiguous time ratio.  Goals: ratio <= 1.10,
and >= 70% of peak for decode at batch >= 64.  Physical blocks are shuffled (a fragmented cache).
Small shapes fit in L2, so their "bandwidth" can exceed HBM peak: read the large rows.

Without CUDA: runs a small correctness check of both kernels in the Triton interpreter; the
figures need a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch.nn.functional as F  # noqa: E402

from pagedserve_kernels.paged_attention import paged_attention_triton  # noqa: E402
from pagedserve_kernels.paged_decode import choose_partition  # noqa: E402
from ops import reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small grid, fewer repetitions")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 8192])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak assumed (H200: 4800 GB/s)")
    p.add_argument("--prefill-max-tokens", type=int, default=65536,
                   help="skip prefill points with more query tokens than this (time, memory)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--partition", type=int, default=None, help="decode split-K partition (tokens)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.warmup, args.reps = [1, 64], [128, 2048], 3, 10
    return args


class Setup:
    """One batch: a shuffled paged cache, and the same K/V as contiguous [batch, kv_heads, ctx, dim]."""

    def __init__(self, args, batch, context, q_len, device, contiguous=True):
        dtype, bs = DTYPES[args.dtype], args.block_size
        per_seq = -(-context // bs)
        num_blocks = batch * per_seq
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)
        perm = torch.randperm(num_blocks, device=device).to(torch.int32)
        self.block_tables = perm.view(batch, per_seq)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
        self.query = torch.randn(batch * q_len, args.heads, args.head_dim, device=device, dtype=dtype)
        self.scale, self.q_len, self.batch, self.context = args.head_dim ** -0.5, q_len, batch, context
        if contiguous:
            idx = self.block_tables.long()
            self.k = self._gather(idx, self.k_cache)
            self.v = self._gather(idx, self.v_cache)
            self.q = self.query.view(batch, q_len, args.heads, args.head_dim).transpose(1, 2)

    def _gather(self, idx, cache):
        flat = cache[idx].flatten(1, 2)[:, :self.context]  # [batch, ctx, kv_heads, dim]
        return flat.transpose(1, 2).contiguous()

    def paged(self, partition=None):
        return paged_attention_triton(self.query, self.k_cache, self.v_cache, self.block_tables,
                                      self.seq_lens, self.query_start_loc, self.scale,
                                      max_query_len=self.q_len, partition_size=partition)

    def contiguous(self):
        return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.q_len > 1,
                                              scale=self.scale, enable_gqa=True)

    def bytes_moved(self):
        kv = 2 * self.k_cache[0, 0].numel() * self.k_cache.element_size() * self.batch * self.context
        return kv + 2 * self.query.numel() * self.query.element_size()  # + q read, out written

    def flops(self):
        # causal: query i (position ctx - q_len + i) sees ctx - q_len + i + 1 keys; 2 matmuls x 2 flops
        q, c = self.q_len, self.context
        keys = q * (c - q) + q * (q + 1) // 2
        return 4 * self.batch * self.query.shape[1] * self.query.shape[2] * keys


def cuda_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fits(args, batch, context, q_len):
    itemsize = DTYPES[args.dtype].itemsize
    kv = 2 * batch * context * args.kv_heads * args.head_dim * itemsize
    q = 2 * batch * q_len * args.heads * args.head_dim * itemsize
    need = 2.5 * kv + 2 * q  # paged + contiguous copies + the gather temporary
    return need < 0.8 * torch.cuda.mem_get_info()[0]


def run_gpu(args):
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; peak assumed {args.peak_gbps:.0f} GB/s "
          f"(--peak-gbps); {args.dtype}, heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, "
          f"block {args.block_size}; median of {args.reps} reps after {args.warmup} warmup", flush=True)
    header = (f"{'kind':8}{'batch':>6}{'ctx':>6}{'parts':>6}{'paged ms':>10}{'contig ms':>10}{'ratio':>7}"
              f"{'GB/s':>8}{'%peak':>7}{'TFLOP/s':>9}{'maxerr':>9}  goal")
    rows = []
    points = [(k, b, c) for k in ("decode", "prefill") for b in args.batches for c in args.contexts]
    for n, (kind, batch, context) in enumerate(points, 1):
        q_len = 1 if kind == "decode" else context
        tag = f"[{n}/{len(points)}] {kind} batch {batch} ctx {context}"
        if kind == "prefill" and batch * context > args.prefill_max_tokens:
            print(f"{tag}: skipped (> --prefill-max-tokens)", flush=True)
            continue
        if not fits(args, batch, context, q_len):
            print(f"{tag}: skipped (GPU memory)", flush=True)
            continue
        print(f"{tag} ...", flush=True)
        s = Setup(args, batch, context, q_len, device)
        err = (s.paged(args.partition).float()
               - s.contiguous().transpose(1, 2).reshape_as(s.query).float()).abs().max().item()
        paged_ms = cuda_ms(lambda: s.paged(args.partition), args.warmup, args.reps)
        contig_ms = cuda_ms(s.contiguous, args.warmup, args.reps)
        gbps = s.bytes_moved() / paged_ms / 1e6
        tflops = s.flops() / paged_ms / 1e9
        parts = "-"
        if kind == "decode":
            max_ctx = -(-context // args.block_size) * args.block_size  # as paged_decode sees it
            part = args.partition or choose_partition(batch, args.kv_heads, max_ctx, device)
            parts = str(-(-max_ctx // part)) if part < max_ctx else "1"
        ratio = paged_ms / contig_ms
        goal = "ratio ok" if ratio <= 1.10 else "ratio MISS"
        if kind == "decode" and batch >= 64:
            goal += ", bw ok" if gbps >= 0.7 * args.peak_gbps else ", bw MISS"
        rows.append(f"{kind:8}{batch:>6}{context:>6}{parts:>6}{paged_ms:>10.3f}{contig_ms:>10.3f}{ratio:>7.2f}"
                    f"{gbps:>8.0f}{100 * gbps / args.peak_gbps:>6.0f}%{tflops:>9.1f}{err:>9.1e}  {goal}")
        print("    " + rows[-1], flush=True)
        del s
        torch.cuda.empty_cache()
    print("\n" + header)
    print("\n".join(rows))


def run_cpu_check(args):
    print("no CUDA: correctness check in the Triton interpreter (TRITON_INTERPRET=1); "
          "time and bandwidth figures need a GPU", flush=True)
    # small and float32 (exact comparison); head_dim 80 exercises the padded head dimension
    args.dtype, args.heads, args.kv_heads, args.head_dim = "fp32", 4, 2, 80
    worst = 0.0
    for kind, batch, context in [("decode", 4, 200), ("decode", 2, 1000), ("prefill", 2, 96)]:
        q_len = 1 if kind == "decode" else context
        t0 = time.perf_counter()
        s = Setup(args, batch, context, q_len, torch.device("cpu"), contiguous=False)
        partition = 128 if kind == "decode" else None  # exercise split-K in the decode case
        out = s.paged(partition)
        ref = reference.paged_attention(s.query, s.k_cache, s.v_cache, s.block_tables, s.seq_lens,
                                        s.query_start_loc, s.scale)
        err = (out - ref).abs().max().item()
        worst = max(worst, err)
        print(f"  {kind:8} batch {batch} ctx {context:5}: max |paged - reference| = {err:.2e} "
              f"({time.perf_counter() - t0:.1f} s interpreted)", flush=True)
    print("correctness:", "OK" if worst < 1e-4 else "FAILED")
    return 0 if worst < 1e-4 else 1


def main(argv=None):
    args = parse_args(argv)
    if torch.cuda.is_available():
        run_gpu(args)
        return 0
    return run_cpu_check(args)


if __name__ == "__main__":
    sys.exit(main())
