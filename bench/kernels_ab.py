"""This checkout's CPU kernels against those of another git revision, alternating in one process.

    python bench/kernels_ab.py --before HEAD~2            # attention and the 120 coded products
    python bench/kernels_ab.py --before 8a47f95 --only attention
    python bench/kernels_ab.py --before HEAD~1 --only bf16 --rows 7,8,64,512
    python bench/kernels_ab.py --before HEAD~1 --only plain --rows 1,8,16,32

The revision's pagedserve_kernels/cpu/ is built into the torch extension cache under its own name (a minute the
first time). Then, repetition by repetition, the two builds take the same inputs, so that a change in
the machine's load hits both alike; medians are printed with after/before, and every pair of outputs
must be equal bit for bit (a change to speed must not change results):
  attention  paged decode over 30 layers of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64),
             blocks shuffled over a pool, float32 and bfloat16, a grid of rows x context (every row
             at that context, or contexts spread around it, in random order or longest first);
  products   every layer product of SmolLM2's lean forward through the GGUF codes (float32, or bfloat16
             inputs with --dtypes), at a few row counts (the model is loaded as the data plane loads it);
  bf16       every layer product of the bfloat16 lean forward through bf16_linear, on the weights laid out at
             start (where that kernel is the route: AVX512-BF16 without AMX), at the same row counts;
  plain      the fused layer products of bench/random_model.py's 415M Llama (hidden 1024, MLP 4096, 16/4
             heads, 24 layers) with random plain weights, no codes: float32 through panel_linear, bfloat16
             through the kernel that is its route on this CPU (bf16_linear with AVX512-BF16, bf16_dots_linear
             on AVX2 alone; oneDNN's GEMM with AMX, not compared);
  greedy     the greedy head's token and logit (pagedserve_kernels/cpu/greedy_head.cpp) for random float32 rows of
             the hidden size, at the same row counts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# rows, context, and how the contexts differ: "" all equal, "spread" uniform in 8 .. 2 context - 8, "oldest
# first" the same spread sorted longest first, as a decode step's rows come
GRID = [(1, 128, ""), (1, 512, ""), (8, 128, ""), (64, 64, ""), (64, 128, ""), (64, 256, ""),
        (8, 128, "spread"), (64, 128, "spread"), (64, 256, "spread"), (64, 256, "oldest first"),
        (64, 64, "prompt"), (128, 128, "prompt"), (192, 192, "prompt")]
LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64


def build_revision(rev: str):
    """The kernels of git revision `rev`, built under a name of their own, loaded."""
    from ops import cpu_kernels
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=10", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    folder = os.path.join(tempfile.gettempdir(), f"pagedserve-kernels-{sha}")
    os.makedirs(folder, exist_ok=True)
    # the package was `kernels` before it became `pagedserve_kernels`; older revisions keep the old folder
    tree = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", sha], check=True, capture_output=True,
                          text=True).stdout.split()
    package = "pagedserve_kernels" if "pagedserve_kernels" in tree else "kernels"
    archive = subprocess.run(["git", "-C", ROOT, "archive", sha, f"{package}/cpu"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    sources = [os.path.join(folder, package, "cpu", os.path.basename(s)) for s in cpu_kernels.SOURCES]
    print(f"building the kernels of {rev} ({sha}) ...", flush=True)
    return cpu_kernels.build(f"pagedserve_cpu_kernels_rev_{sha}", sources), sha


def alternate(before, after, run, repeats: int) -> tuple[float, float]:
    """Median seconds of run(module) for each build, alternating, the first of each pair taking turns (the
    second of a pair ran up to a tenth slower at hundreds of rows, with both builds the same code); their
    results must be equal."""
    import torch
    times: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        results = [None, None]
        for i in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            started = time.perf_counter()
            results[i] = run((before, after)[i])
            times[i].append(time.perf_counter() - started)
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            raise SystemExit("the two builds gave different results")
    return statistics.median(times[0]), statistics.median(times[1])


def attention(before, after, repeats: int) -> None:
    import torch
    from data_plane import kv_pool
    from ops.attention import choose, kernel_rows
    print(f"\npaged decode, {LAYERS} layers, blocks shuffled, in the order the data plane asks for; ms (median of {repeats})")
    print(f"{'dtype':9} {'rows':>4} {'context':>9} {'before':>8} {'after':>8} {'after/before':>12}"
          "   (8-N: contexts spread over 8..N; 8-N<: the same, longest first; N prompt: the rows of one prompt)")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # the data plane's route: torch's SDPA order (its lanes; MKL's order of the products where that was
        # found at start), as data_plane/llama_forward.py calls the kernel
        backend = choose(torch.device("cpu"), dtype)
        if hasattr(before, "set_sdpa_tile_order"):   # (the start-up check chose the order in this checkout's build)
            before.set_sdpa_tile_order(after.sdpa_tile_order())
        num_blocks = max(rows * ctx for rows, ctx, _ in GRID) // BLOCK * 4
        # in huge pages, as the data plane's pool (data_plane/kv_pool.py)
        pool = torch.empty(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        kv_pool.advise_huge_pages(pool)
        pool.copy_(torch.randn(pool.shape, generator=gen))
        for rows, ctx, spread in GRID:
            query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
            if spread == "prompt":   # one sequence's prompt in one step, as the runner hands it (its length known)
                lens = torch.tensor([ctx], dtype=torch.int32)
                tables = torch.randperm(num_blocks, generator=gen)[:-(-ctx // BLOCK)].view(1, -1).to(torch.int32)
                work = kernel_rows(torch.tensor([0, rows], dtype=torch.int32), lens, tables, max_query=rows,
                                   prompt_lens=lens)
            else:
                lens = torch.randint(8, 2 * ctx - 7, (rows,), generator=gen) if spread else torch.full((rows,), ctx)
                if spread == "oldest first":
                    lens = lens.sort(descending=True).values
                width = -(-int(lens.max()) // BLOCK)
                tables = torch.randperm(num_blocks, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
                work = kernel_rows(torch.arange(rows + 1, dtype=torch.int32), lens.to(torch.int32), tables)

            def run(module):
                outs = []
                for layer in range(LAYERS):
                    out = torch.empty_like(query)
                    module.paged_decode(out, query, pool[layer, 0], pool[layer, 1], work.tables, work.lens, work.tokens,
                                        HEAD_DIM ** -0.5, 0, 0.0, None, None, 0, work.ends, backend.sdpa_lanes,
                                        work.qrows if backend.mkl_order else None)
                    outs.append(out)
                return outs
            b, a = alternate(before, after, run, repeats)
            label = f"{ctx} prompt" if spread == "prompt" else \
                (f"8-{2 * ctx - 8}" + ("<" if spread == "oldest first" else "")) if spread else str(ctx)
            print(f"{str(dtype)[6:]:9} {rows:>4} {label:>9} {b * 1e3:>8.2f} {a * 1e3:>8.2f} {a / b:>12.2f}", flush=True)


def products(before, after, rows_list: list[int], repeats: int, num_threads: int, dtype_name: str) -> None:
    import torch
    runner = C.default_runner(num_threads, "inproc://kernels-ab", kv_cache_blocks=16)
    layers = [lin for lin in runner.lean.linears() if lin.codes is not None]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(1)

    def run_for(rows: int):
        inputs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1], generator=gen).to(dtype) for lin in layers}
        # the plain layout, which every revision's coded_linear reads (bfloat16's few rows take the pair
        # order where the build has the dot product: bench/route_rows.py compares the two)
        plain = [lin.codes.plain_order() for lin in layers]
        return lambda module: [module.coded_linear(inputs[lin.weight.shape[1]], codes.codes, codes.scales,
                                                   codes.mins) for lin, codes in zip(layers, plain)]
    rows_table(f"the {len(layers)} layer products through the GGUF codes, {dtype_name}", before, after, rows_list,
               repeats, run_for)


def bf16_products(before, after, rows_list: list[int], repeats: int, num_threads: int) -> None:
    import torch
    if not hasattr(before, "bf16_linear"):
        print("\nthe bfloat16 products: not run (the revision has no bf16_linear)")
        return
    runner = C.default_runner(num_threads, "inproc://kernels-ab-bf16", "bfloat16", kv_cache_blocks=16)
    layers = [lin for lin in runner.lean.linears() if lin.dot is not None]
    if not layers:
        print("\nthe bfloat16 products: not run (bf16_linear is not the route here: AMX, or no AVX512-BF16)")
        return
    gen = torch.Generator().manual_seed(3)

    def run_for(rows: int):
        inputs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1], generator=gen).to(torch.bfloat16)
                  for lin in layers}
        return lambda module: [module.bf16_linear(inputs[lin.weight.shape[1]], lin.dot, None) for lin in layers]
    rows_table(f"the {len(layers)} layer products through bf16_linear, bfloat16", before, after, rows_list,
               repeats, run_for)


# the fused products (qkv, o, gate_up, down) of bench/random_model.py's default model, and its layers
PLAIN_SHAPES, PLAIN_LAYERS = [(1536, 1024), (1024, 1024), (8192, 1024), (1024, 4096)], 24


def plain_products(before, after, rows_list: list[int], repeats: int) -> None:
    import torch
    from ops import linear
    gen = torch.Generator().manual_seed(4)
    weights = [(torch.randn(n, k, generator=gen) * 0.02) for _ in range(PLAIN_LAYERS) for n, k in PLAIN_SHAPES]
    if all(hasattr(module, "panel_linear") for module in (before, after)) and after.has_coded_simd():
        panels = [(after.panel_pack(w), w.shape[0]) for w in weights]

        def run_for(rows: int):
            inputs = {k: torch.randn(rows, k, generator=gen) for _, k in PLAIN_SHAPES}
            return lambda module: [module.panel_linear(inputs[packed.shape[1]], packed, n) for packed, n in panels]
        rows_table(f"the {len(panels)} plain float32 products through panel_linear", before, after, rows_list,
                   repeats, run_for)
        del panels
    narrow = [w.to(torch.bfloat16) for w in weights]
    del weights
    if linear.bf16_dot_kernel(after):
        tensors, name = [after.bf16_pack(w) for w in narrow], "bf16_linear"
    elif linear.bf16_dots_kernel(after):
        tensors, name = narrow, "bf16_dots_linear"
    else:
        print("\nthe plain bfloat16 products: not run (oneDNN's GEMM is their route here)")
        return

    def run_bf16(rows: int):
        inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in PLAIN_SHAPES}
        if name == "bf16_linear":   # (its K is the packed tensor's pairs x 2)
            return lambda module: [module.bf16_linear(inputs[t.shape[1] * 2], t, None) for t in tensors]
        return lambda module: [module.bf16_dots_linear(inputs[t.shape[1]], t) for t in tensors]
    rows_table(f"the {len(tensors)} plain bfloat16 products through {name}", before, after, rows_list, repeats, run_bf16)


def rows_table(title: str, before, after, rows_list: list[int], repeats: int, run_for) -> None:
    """One line per row count: the two builds' median ms of run_for(rows) (a function of the module)."""
    print(f"\n{title}; ms (median of {repeats})")
    print(f"{'rows':>4} {'before':>8} {'after':>8} {'after/before':>12}")
    for rows in rows_list:
        b, a = alternate(before, after, run_for(rows), repeats)
        print(f"{rows:>4} {b * 1e3:>8.2f} {a * 1e3:>8.2f} {a / b:>12.2f}", flush=True)


def greedy(before, after, rows_list: list[int], repeats: int, num_threads: int) -> None:
    import torch

    from ops import greedy_head, quantized
    runner = C.default_runner(num_threads, "inproc://kernels-ab-greedy", kv_cache_blocks=16)
    if runner.greedy_head is None:
        print("\nthe greedy head: not run (neither AVX512-VNNI nor AVX2 in this build, "
              "or the output layer is not Q8_0 codes)")
        return
    gen = torch.Generator().manual_seed(2)
    # SmolLM2's output layer, and one of the 415M model's shape: Q8_0 codes found near random weights (the
    # first pass a plain layer takes, without the bound's share for what the codes miss, which a build from
    # before plain layers lacks)
    near = greedy_head.NearCodes(torch.randn(49152, 1024, generator=gen) * 0.02)
    heads = {"SmolLM2's Q8_0 output layer": runner.greedy_head,
             "Q8_0 codes of the 415M model's output layer (49152 x 1024)":
                 greedy_head.GreedyHead(runner.greedy_head.kernel, quantized.Codes("q8_0", near.codes, near.scales, None))}
    for title, head in heads.items():
        codes = head.codes

        def run_for(rows: int, head=head, codes=codes):
            x = torch.randn(rows, codes.codes.shape[1], generator=gen)
            # builds from before the bound's norms take five arguments, as their doc strings show (later ones
            # name their arguments)

            def call(module):
                doc = module.q8_argmax.__doc__
                more = [t for t, name, since in ((head.norms, "norms", "arg5"), (head.widest, "widest", "arg6"),
                                                 (None, "weight", "arg7")) if name in doc or since in doc]
                return module.q8_argmax(x, head.packed, codes.codes, codes.scales, head.absums, *more)
            return call
        rows_table(f"the greedy head (q8_argmax), {title}, random rows", before, after, rows_list, repeats, run_for)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a git revision whose pagedserve_kernels/cpu/ is the baseline")
    ap.add_argument("--only", choices=("attention", "products", "bf16", "plain", "greedy"))
    ap.add_argument("--rows", default="1,4,64", help="row counts of the products and the greedy head")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32", help="the products' input and output types (float32, bfloat16)")
    args = ap.parse_args(argv)
    import torch
    from ops import cpu_kernels
    torch.set_num_threads(args.num_threads)
    print(C.machine_line(args.num_threads))
    after = cpu_kernels.load()
    if after is None:
        print(f"not run: this checkout's kernels did not build ({cpu_kernels.failure()})")
        return 1
    before, sha = build_revision(args.before)
    print(f"before: {args.before} ({sha}); after: this checkout's pagedserve_kernels/cpu/")
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        if args.only in (None, "attention"):
            attention(before, after, args.repeats)
        if args.only in (None, "products"):
            for dtype_name in args.dtypes.split(","):
                products(before, after, rows, args.repeats, args.num_threads, dtype_name)
        if args.only in (None, "bf16"):
            bf16_products(before, after, rows, args.repeats, args.num_threads)
        if args.only in (None, "plain"):
            plain_products(before, after, rows, args.repeats)
        if args.only in (None, "greedy"):
            greedy(before, after, rows, args.repeats, args.num_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
