"""The order in which MKL's bfloat16 GEMM (cblas_gemm_bf16bf16f32, inside torch) adds its float32 terms, for the
two products of torch's flash attention: q.k (k = the head's 64 dimensions) and the weighted values (k = the
keys). pagedserve_kernels/cpu/paged_decode.cpp follows the order MKL takes on the CPU (ops/sdpa_order.py checks
which); this reads it from MKL itself, through ctypes, so that a new CPU's order can be read term by term.

    python bench/mkl_order.py                 # the kernel's known orders against MKL on random products
    python bench/mkl_order.py --tree 100,1,0  # which terms of q.k meet before term 0 (100 keys, one query row)
    python bench/mkl_order.py --brgemm        # oneDNN's brgemm (torch's packed flash attention) against its groups

--tree M,N,B: per pair of dimensions x, y, whether their terms are added together before the term of
dimension B joins them ("1") or after ("0"), for an output of a call of M keys and N query rows; the terms are
1 at B and 2^-24 at x and y (half a unit in the last place of 1: 1 + 2^-23 only when x and y met first).
The default run prints, per order, the outputs whose bits differ from MKL's on random bfloat16 inputs.
--brgemm: torch's flash attention takes its products from torch's cpublas::brgemm (oneDNN) instead where it packs
bfloat16 (AMX tiles; calls of 64 query rows and keys or more): per count of summed inputs K, the outputs whose bits
differ from the tile order in groups of the largest even divisor of K (rounded up to even) up to 32, the order
pagedserve_kernels/cpu/paged_decode.cpp follows there (brgemm_group), and from MKL's groups of 32.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops.linear import tile_order_product  # noqa: E402

COL, NO, TRANS = 102, 111, 112   # CBLAS's column-major layout and transposes
D = 64                            # SmolLM2's head dimension


def mkl_gemm():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    fn = lib.cblas_gemm_bf16bf16f32
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.restype, fn.argtypes = None, [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    return fn


def scores(gemm, keys: torch.Tensor, queries: torch.Tensor) -> np.ndarray:
    """[N, M] = queries . keys^T as torch's flash attention calls MKL for it (keys [M, D], queries [N, D])."""
    m, n = keys.shape[0], queries.shape[0]
    out = torch.zeros(n * m)
    gemm(COL, TRANS, NO, m, n, D, 1.0, keys.data_ptr(), D, queries.data_ptr(), D, 0.0, out.data_ptr(), m)
    return out.view(n, m).numpy()


def weighted(gemm, values: torch.Tensor, weights: torch.Tensor) -> np.ndarray:
    """[N, D] = weights . values as torch calls MKL for it (values [K, D], weights [N, K], bfloat16)."""
    k, n = values.shape[0], weights.shape[0]
    out = torch.zeros(n * D)
    gemm(COL, NO, NO, D, n, k, 1.0, values.data_ptr(), D, weights.data_ptr(), k, 0.0, out.data_ptr(), D)
    return out.view(n, D).numpy()


def _pairs_odd_first(terms: np.ndarray, indices) -> np.ndarray:
    acc, k = np.zeros(terms.shape[:-1], np.float32), terms.shape[-1]
    for j in indices:
        if j + 1 < k:
            acc = (acc + terms[..., j + 1]).astype(np.float32)
        acc = (acc + terms[..., j]).astype(np.float32)
    return acc


def decode_scores_order(terms: np.ndarray) -> np.ndarray:
    """One query row's q.k with AMX tiles: 16 lanes, lane i adding dimensions 2i + 1, then 2i, of each group of
    32; lane i + 8 added to lane i, then the eight lanes pairwise."""
    lanes = [_pairs_odd_first(terms, range(2 * i, D, 32)) for i in range(16)]
    sums = [(lanes[i] + lanes[i + 8]).astype(np.float32) for i in range(8)]
    while len(sums) > 1:
        sums = [(sums[i] + sums[i + 1]).astype(np.float32) for i in range(0, len(sums), 2)]
    return sums[0]


def decode_values_order(terms: np.ndarray) -> np.ndarray:
    """One query row's weighted values with AMX tiles: per group of 8 keys, from zero, keys 2j + 1 then 2j; each
    group's sum added to the running sum."""
    k, total = terms.shape[-1], np.zeros(terms.shape[:-1], np.float32)
    for g in range(0, k, 8):
        total = (total + _pairs_odd_first(terms, range(g, min(k, g + 8), 2))).astype(np.float32)
    return total


def check(gemm, seeds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(n, m) for n in (1, 2, 7, 32) for m in (2, 5, 17, 64, 97, 193, 512)]
    for n, m in shapes:
        differ, total = [0, 0], 0
        for _ in range(seeds):
            keys, queries = (torch.randn(r, D, generator=gen).to(torch.bfloat16) for r in (m, n))
            weights = torch.rand(n, m, generator=gen).to(torch.bfloat16)
            if n == 1:   # a decode row: the orders below
                s_order = decode_scores_order((queries.float()[:, None, :] * keys.float()[None]).numpy())
                v_order = decode_values_order((weights.float()[:, None, :] * keys.float().T[None]).numpy())
            else:        # two or more query rows: the tile order, as ops/linear.py computes it
                s_order = tile_order_product(queries, keys.t()).numpy()
                v_order = tile_order_product(weights, keys).numpy()
            differ[0] += int((s_order != scores(gemm, keys, queries)).sum())
            differ[1] += int((v_order != weighted(gemm, keys, weights)).sum())
            total += n * m
        print(f"{n:3d} query rows, {m:3d} keys: q.k {differ[0]} of {total} differ, weighted values {differ[1]} of "
              f"{n * D * seeds} differ")


def torch_brgemm():
    """torch's cpublas::brgemm for bfloat16 (A [M, K] row-major, B [K, N] in pairs of K: vnni2), or None where
    torch cannot pack bfloat16 (no AMX tiles): then its flash attention never takes it."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    could_pack = lib._ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE
    could_pack.restype, could_pack.argtypes = ctypes.c_bool, [ctypes.c_int]
    if not could_pack(15):   # c10::ScalarType::BFloat16
        return None
    fn = lib._ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb
    n, b, p = ctypes.c_int64, ctypes.c_bool, ctypes.c_void_p
    fn.restype, fn.argtypes = None, [n, n, n, n, n, n, b, p, p, p, b]
    release = lib._ZN2at6native7cpublas14brgemm_releaseEb
    release.restype, release.argtypes = None, [ctypes.c_bool]

    def product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = a.shape
        if k % 2:   # (torch pads an odd K with a zero, as here)
            a, w = torch.cat([a, a.new_zeros(m, 1)], 1), torch.cat([w, w.new_zeros(1, w.shape[1])])
        pairs = w.reshape(-1, 2, w.shape[1]).transpose(1, 2).contiguous()
        out = torch.zeros(m, w.shape[1])
        fn(m, w.shape[1], a.shape[1], a.shape[1], w.shape[1], w.shape[1], False, a.contiguous().data_ptr(),
           pairs.data_ptr(), out.data_ptr(), True)
        release(True)
        return out
    return product


def brgemm_group(k: int) -> int:
    """brgemm's group of inputs for K inputs (as paged_decode.cpp's brgemm_group)."""
    even = k + k % 2
    return next(g for g in range(32, 0, -2) if even % g == 0)


def check_brgemm(seeds: int) -> None:
    product = torch_brgemm()
    if product is None:
        print("torch packs no bfloat16 on this CPU (cpublas::could_pack): its flash attention keeps MKL's GEMM")
        return
    gen = torch.Generator().manual_seed(0)
    print("K inputs (group): outputs differing from the groups' order / from groups of 32, of all")
    for k in (2, 17, 33, 34, 63, 64, 65, 66, 67, 80, 96, 97, 98, 125, 126, 128, 150, 191, 192, 193, 250, 300, 512):
        differ, total = [0, 0], 0
        for _ in range(seeds):
            a = torch.randn(8, k, generator=gen).to(torch.bfloat16)
            w = torch.randn(k, D, generator=gen).to(torch.bfloat16)
            got = product(a, w)
            differ[0] += int((got != tile_order_product(a, w, brgemm_group(k))).sum())
            differ[1] += int((got != tile_order_product(a, w)).sum())
            total += got.numel()
        print(f"  K {k:3d} ({brgemm_group(k):2d}): {differ[0]} / {differ[1]} of {total}")


def tree(gemm, m: int, n: int, b: int) -> None:
    tiny = 2.0 ** -12
    for x in range(D):
        line = []
        for y in range(D):
            if x == b or y in (x, b):
                line.append("b" if x == b else ".")
                continue
            keys, queries = torch.zeros(m, D), torch.ones(n, D)
            keys[0, b], keys[0, x], keys[0, y] = 1.0, tiny, tiny
            queries[0, x] = queries[0, y] = tiny
            value = scores(gemm, keys.to(torch.bfloat16), queries.to(torch.bfloat16))[0, 0]
            line.append("1" if value == np.float32(1 + 2.0 ** -23) else "0")
        print(f"{x:2d} {''.join(line)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", help="M,N,B: keys, query rows, the dimension whose term the others meet")
    ap.add_argument("--seeds", type=int, default=3, help="random inputs per shape")
    ap.add_argument("--brgemm", action="store_true", help="oneDNN's brgemm's groups (torch's packed products)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gemm = mkl_gemm()
    if args.brgemm:
        check_brgemm(args.seeds)
    elif args.tree:
        tree(gemm, *(int(v) for v in args.tree.split(",")))
    else:
        print("the kernel's tile order (AMX) against MKL's cblas_gemm_bf16bf16f32 on this CPU:")
        check(gemm, args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
