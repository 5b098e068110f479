"""Where the bfloat16 routes cross: every linear layer of SmolLM2's lean forward (120 products) at a
given row count, through the kernel reading the GGUF codes, the AVX512-BF16 kernel (where the build
has it), oneDNN's packed GEMM, and with AMX the kernel's own tile product on the bfloat16 weights and on
tiles expanded from the codes as it goes. Where the runner keeps its few-row codes in the dot product's pair
order, a column shows the same products from the plain order (the codes' route before it). With
--dtype float32: the codes, the few-row kernel and MKL's packed GEMM over the float32 weights. On a
CPU with AVX2 alone, where every bfloat16 row count sums in the order of torch's own GEMM: that order
from the codes and from the bfloat16 weights (ops/linear.DOTS_CODES_MAX_ROWS is set from this).
--output-layer: the output layer alone instead of the 120 products.

    python bench/route_rows.py                  # rows 1, 2, 4, 8, 12, 16, 24, 32, 64, 512
    python bench/route_rows.py --dtype float32
    python bench/route_rows.py --rows 1,2,3,4,5,6,8 --output-layer

The model is loaded in float32 and narrowed by the data plane's runner, as `--dtype bfloat16` serves
it, so every route multiplies the same bfloat16 weights; ops/linear.BF16_CODES_MAX_ROWS and
BF16_DOT_CODES_MAX_ROWS are set from this. Best of three, each two passes over every layer (weights
from memory, as in a step).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,64,512")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--output-layer", action="store_true", help="time the output layer, not the 120 products")
    args = ap.parse_args(argv)
    import torch

    print(C.machine_line(args.num_threads))
    runner = C.default_runner(args.num_threads, "inproc://routes", args.dtype, kv_cache_blocks=16)
    from ops import linear
    layers = [runner.model.get_output_embeddings().forward] if args.output_layer else runner.lean.linears()
    kernel = layers[0].kernel
    if args.dtype == "bfloat16" and layers[0].dots:
        if any(lin.dots_codes is None for lin in layers):
            print("not run: some layer lacks its codes (they do not give its bfloat16 weight back)")
            return 1
        routes = {"codes": lambda i, x: kernel.bf16_dots_codes_linear(x, *layers[i].dots_codes),
                  "bf16 weights": lambda i, x: kernel.bf16_dots_linear(x, layers[i].weight)}
        print(f"every row count in the order of torch's own GEMM; the runner reads the codes up to "
              f"{linear.DOTS_CODES_MAX_ROWS} rows")
        return _table(routes, layers, args.rows, torch.bfloat16)
    if any(lin.codes is None for lin in layers):
        print("not run: some layer lacks its codes (on this CPU its route does not read them)")
        return 1
    dtype = getattr(torch, args.dtype)
    if args.dtype == "float32":
        packed = [linear._pack(lin.weight) for lin in layers] if linear.has_packed_gemm() else None
        routes = {"codes": lambda i, x: layers[i].codes.linear(kernel, x),
                  "few-row kernel": lambda i, x: kernel.skinny_linear(x, layers[i].weight)}
        if packed is not None:
            routes["MKL packed"] = lambda i, x: linear._packed_gemm(x, packed[i], layers[i].weight, None, x.shape[0])
        return _table(routes, layers, args.rows, dtype)
    # each layer's weight laid out for every route, whichever the runner chose
    onednn = [linear._pack(lin.weight) for lin in layers] if linear.has_packed_bf16_gemm() else None
    dot = [kernel.bf16_pack(lin.weight) for lin in layers] if kernel.has_bf16_dot() else None
    # the runner's codes serve up to BF16_CODES_MAX_ROWS rows, in the dot product's pair order where the
    # build has it; the plain order beside them, and for more rows
    plain = [lin.codes.plain_order() for lin in layers]
    routes = {"codes": lambda i, x: (layers[i].codes if x.shape[0] <= linear.BF16_CODES_MAX_ROWS else plain[i])
              .linear(kernel, x)}
    if layers[0].codes.paired:
        routes["codes, plain order"] = lambda i, x: plain[i].linear(kernel, x)
    if dot is not None:
        routes["AVX512-BF16"] = lambda i, x: kernel.bf16_linear(x, dot[i])
    if onednn is not None:
        routes["oneDNN"] = lambda i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
    if layers[0].tiles is not None:   # the kernel's own AMX tile product, on bf16_pack's copy and from the codes
        routes["AMX tiles"] = lambda i, x: kernel.amx_linear(x, layers[i].tiles)
        if all(lin.tile_codes for lin in layers):
            routes["AMX from codes"] = lambda i, x: kernel.amx_codes_linear(
                x, layers[i].codes.codes, layers[i].codes.scales, layers[i].codes.mins)
    many = 'AVX512-BF16' if layers[0].dot is not None else 'oneDNN' if layers[0].tiles is None else \
        'AMX tiles from the codes' if layers[0].tile_codes else 'AMX tiles'
    print(f"the runner's route for many rows: {many}")
    return _table(routes, layers, args.rows, dtype)


def _table(routes: dict, layers, rows_arg: str, dtype) -> int:
    """Prints each route's time over every layer, per row count."""
    import torch

    def time_route(route, rows: int) -> float:
        inputs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1]).to(dtype) for lin in layers}

        def once():
            for i, lin in enumerate(layers):
                route(i, inputs[lin.weight.shape[1]])
        once()
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            once()
            once()
            best = min(best, (time.perf_counter() - started) / 2)
        return best * 1e3

    print(f"{'rows':>5} " + " ".join(f"{name + ' ms':>15}" for name in routes))
    with torch.inference_mode():
        for rows in (int(r) for r in rows_arg.split(",")):
            print(f"{rows:>5} " + " ".join(f"{time_route(fn, rows):>15.1f}" for fn in routes.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
