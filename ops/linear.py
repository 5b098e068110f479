"""Linear layers on CPU, routed by the weight's type and the number of rows a step brings.

bfloat16, by what the CPU has:

- AVX512-BF16 dot products but no AMX tiles (AMD Zen 4 and later, Intel Cooper Lake): the kernel of
  pagedserve_kernels/cpu/bf16_linear.cpp on a weight laid out once at start for it. On SmolLM2's products it was
  1.1x oneDNN's GEMM at 64-512 rows and 1.3-2x at 1-32 (bench/route_rows.py). Exact products and
  float32 sums in oneDNN's order (pagedserve_kernels/cpu/simd.h, onednn_bf16_chunk): `F.linear`'s bits at every
  row count and thread count (tests/kernels/test_bf16_onednn_order.py), so a row's result does not
  depend on the other rows of the call.
- AMX tiles, where oneDNN's calls of up to TILE_CALL_ROWS rows sum in the tiles' order (`onednn_tile_order`):
  the kernel of pagedserve_kernels/cpu/amx_linear.cpp on the AVX512-BF16 kernel's layout, every row summed over
  all of K in one accumulator, so that a row has the bits of a call of it alone (a generated token's, as
  transformers computes it) at every row count; the rows of a prompt of more rows, which transformers computes in
  one call, the order of oneDNN's call of the prompt's length (`onednn_chunk`; `own` in RoutedLinear.route).
- otherwise oneDNN's GEMM (`torch.ops.mkldnn._linear_pointwise`, the op inductor's freezing uses) on a
  weight reordered once at start into oneDNN's blocked layout: bit for bit `F.linear` on the same
  bfloat16 tensors (which reorders the weight at every call), at every row count and whatever the
  batch; oneDNN picks AMX tiles where the CPU has them, or a float32 emulation.
- a weight that is GGUF codes rounded to bfloat16 reads the codes for up to BF16_CODES_MAX_ROWS rows, or
  BF16_DOT_CODES_MAX_ROWS where the AVX512-BF16 kernel takes more rows (a few rows are bound by reading
  the weights; codes are a third of the bytes; above them with AMX tiles, Q4_1 codes feed the tiles,
  `amx_codes_linear`, expanded as it goes); with AVX512-BF16 in
  oneDNN's order as well (the codes then laid out in the dot product's pair order, Codes.paired_order; with
  AMX tiles the order oneDNN's GEMM takes there, `onednn_tile_order`),
  else as an FMA chain over k (one bfloat16 step off `F.linear` at times).
- AVX2 alone: torch's own GEMM is `F.linear`'s route, and every row count takes the kernel that sums in
  its order (pagedserve_kernels/cpu/bf16_dots_linear.cpp); a weight that is GGUF codes rounded to
  bfloat16 reads its codes for up to DOTS_CODES_MAX_ROWS rows, in the same order (the same bits).

float32:

- a weight whose float32 values are exactly GGUF Q4_1 or Q8_0 codes expanded (as the default model's
  are; ops/quantized.py finds them) goes through the kernel that reads the codes
  (pagedserve_kernels/cpu/coded_linear.cpp) at every row count where that kernel is vectorized (AVX-512, or AVX2
  with F16C): over all of SmolLM2's Q4_1 layers it was 2.2x the routes below at 1 row, 2.0x at 16, 1.3x at
  64 and 1.06x at 512 (AVX-512); 3.7x at 1 row, 1.8x at 16 and 1.4x at 64 (AVX2 alone, bench/route_rows.py
  --dtype float32);
- other float32 weights go through the same kernel's tiles where it is vectorized, from a copy laid out once
  at start in its panels (`panel_linear`): every row count, each output the same FMA chain over k as with
  codes, so a row's result does not depend on its batch (MKL's GEMM below is slowest at decode's row counts);
- else, 1..SKINNY_MAX_ROWS rows: the few-row kernel (pagedserve_kernels/cpu/skinny_linear.cpp), which streams each
  weight row once at about the memory's bandwidth;
- more rows: MKL's GEMM on a weight packed once at start (`torch.ops.mkl._mkl_linear`, the op
  inductor's freezing uses), which skips the packing of the weight that `F.linear` redoes on
  every call;
- without MKL or the kernel: torch's own `F.linear`.

The packed copy takes about as much resident memory as the weight itself (MKL's size estimate is
larger, but the untouched pages are never resident). The packed format does not depend on the row
count: a weight packed for 64 rows gives, for every count from 2 to 1000, the same result as one
packed for that count (measured on SmolLM2's shapes), so one packed copy serves every step; the op
falls back to `F.linear` unless it is told the rows it was packed for, so each call passes its own.
The float32 panels take the weight's memory too, with the outputs rounded up to a whole panel (48, or 32 on
AVX2).
"""
from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

from ops import cpu_kernels, quantized

# measured on the runner's decode step, alternating (quiet machine): the kernel is even with the packed GEMM
# up to 12 rows and 7% slower at 16; the packed GEMM is 1.10-1.14x F.linear at 32-64 rows
SKINNY_MAX_ROWS = 8
# bfloat16 weights that are GGUF codes: up to this many rows through the kernel reading the codes (a few
# rows are bound by reading the weights), more through oneDNN's GEMM (AMX tiles: faster from 5 rows on)
BF16_CODES_MAX_ROWS = 4
# the same where the many-row route is the AVX512-BF16 kernel (no AMX): the codes' dot product holds up to
# 8 rows in registers, and reads a third of the bytes (every product of SmolLM2: bench/route_rows.py)
BF16_DOT_CODES_MAX_ROWS = 8
# AVX2 alone: bfloat16 weights that are GGUF codes, in the order of torch's own GEMM: up to this many rows
# through the kernel reading the codes (each output's codes expanded once for all rows), more through the one
# reading the bfloat16 weight, which is as fast from about 16 rows on (bench/route_rows.py held to AVX2)
DOTS_CODES_MAX_ROWS = 12
# the kernels that read codes (RoutedLinear.codes_route names them), numbered as CodedLayers
# (pagedserve_kernels/cpu/coded_layers.h) takes them
CODES_KERNELS = ("coded_linear", "coded_pairs_linear", "bf16_dots_codes_linear")
# the bfloat16 kernels of more rows than the codes serve (RoutedLinear.wide_route names them), numbered from 1 as
# CodedLayers takes them
WIDE_KERNELS = ("bf16_linear", "bf16_dots_linear", "amx_linear", "amx_codes_linear")
# oneDNN's bfloat16 GEMM on AMX tiles sums a call of up to this many rows over all of K in one tile accumulator
# (the tiles' order: `tile_order_product`), but a call of more in blocks of K chosen by the call's shape, whose
# sums it adds afterwards: a row's bits then depend on its call's row count and outputs (measured on SmolLM2's
# products: from 33 rows on, rows differ from the same rows' one-row calls, more with more rows)
TILE_CALL_ROWS = 32
PACK_ROWS_HINT = 64   # the row count the weight is packed for; see the module's docstring
# oneDNN generates its GEMM's code the first time it meets a row count (its cache then keeps it): a few
# milliseconds a weight shape, which a decode step pays once for each new batch size. warm_up has that done
# at start for the batch sizes up to here, where the steps are short enough for the stall to show
WARM_ROWS = 64


def _packed_gemm(x, packed, weight, bias, rows):
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def has_packed_gemm() -> bool:
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def has_packed_bf16_gemm() -> bool:
    """oneDNN's packed bfloat16 GEMM exists in this build and runs on this CPU (it needs AVX-512 or
    AVX-NE-CONVERT: on an AVX2-only CPU packing a weight raises, and bfloat16 products stay torch's)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


def onednn_amx() -> bool:
    """Whether oneDNN's bfloat16 products take AMX tiles here: the CPU has them (torch asks the CPU, whatever
    the ISA oneDNN is held to) and oneDNN is not held below them (`ONEDNN_MAX_CPU_ISA` naming an ISA without
    AMX: `make test-avx512` holds a CPU with AMX to the paths of one with AVX512-BF16 alone)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return amx is not None and bool(amx()) and (held in ("", "ALL") or "AMX" in held)


def bf16_dot_kernel(kernel) -> bool:
    """Whether bfloat16 products take the kernel's AVX512-BF16 route: the build has it, and oneDNN has no AMX
    tiles (its AMX kernels are faster there)."""
    return kernel is not None and kernel.has_bf16_dot() and not onednn_amx()


@functools.cache
def onednn_tile_order(kernel) -> bool:
    """Whether oneDNN's bfloat16 GEMM sums a call of up to TILE_CALL_ROWS rows in the order of AMX tiles (per group
    of 32 inputs, the even and the odd inputs' products in sums of their own, added, then to the running sum),
    checked once on a CPU with AMX tiles: that many random rows against 8,192 outputs, that order computed by torch
    in float32 (the products of two bfloat16 values are exact; the other order gives other bits on about one output
    in 8,000). Where it holds, the codes' few-row kernel sums in it too (`set_bf16_tile_order`) and the kernel's own
    tile product (`amx_linear`) takes the rows above the codes', so a generated token's products are `F.linear`'s, as
    transformers computes them alone, whatever the batch."""
    if kernel is None or not kernel.has_bf16_dot() or not has_packed_bf16_gemm() or not onednn_amx():
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TILE_CALL_ROWS, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(8192, 576, generator=gen) * 0.05).to(torch.bfloat16)
    with torch.no_grad():
        same = torch.equal(F.linear(x, w), tile_order_product(x, w.t()).to(torch.bfloat16))
    kernel.set_bf16_tile_order(same)
    return same


def tile_order_product(a: torch.Tensor, b: torch.Tensor, group: int = 32) -> torch.Tensor:
    """a [R, K] . b [K, N] of bfloat16 values in float32, added as AMX tiles add it (oneDNN's and MKL's bfloat16
    GEMMs with them): per group of `group` (even) inputs from the first, the even and the odd inputs' products in
    sums of their own, added together, then to the running sum. Each product of two bfloat16 values is exact in
    float32, so each step rounds as the hardware's does. (oneDNN's brgemm takes groups of other sizes:
    bench/mkl_order.py --brgemm.)"""
    a, b = a.float().t().contiguous(), b.float().contiguous()   # input i's column of a, and its row of b
    total = torch.zeros(a.shape[1], b.shape[1])
    for g in range(0, a.shape[0], group):
        sums = [torch.zeros_like(total), torch.zeros_like(total)]
        for i in range(g, min(g + group, a.shape[0])):
            sums[i % 2] = sums[i % 2] + a[i, :, None] * b[i]
        total = total + (sums[0] + sums[1])
    return total


_chunks: dict[tuple, int | None] = {}
_probes: dict[tuple, tuple] = {}


def probe_data(kernel, rows: int, outputs: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """onednn_chunk's random rows [rows, inputs], weight [outputs, inputs] and the weight's tiles layout, the second
    half of each row's products nearly cancelling the first (bench/onednn_chunks.py reads with them too): made once
    per weight shape (the rows as many as asked yet, grown by doubling) and kept."""
    half = inputs // 2
    x_half, w, tiles = _probes.get((outputs, inputs), (None, None, None))
    if w is None:
        gen = torch.Generator().manual_seed(outputs * 100003 + inputs)
        w = torch.randn(outputs, half, generator=gen)
        w = torch.cat([w, torch.randn(outputs, half, generator=gen) * 2 ** -7 - w], 1).to(torch.bfloat16)
        tiles = kernel.bf16_pack(w)
    if x_half is None or x_half.shape[0] < rows:
        gen = torch.Generator().manual_seed(rows)
        x_half = torch.randn(max(rows, 2 * (0 if x_half is None else x_half.shape[0]), 64), half, generator=gen)
    _probes[(outputs, inputs)] = (x_half, w, tiles)
    x = x_half[:rows].to(torch.bfloat16)
    return torch.cat([x, x], 1), w, tiles


class OwnCalls:
    """The rows of a step that transformers computes in bfloat16 calls of more than TILE_CALL_ROWS rows (prompts), as
    `ranges` (start, end, rows, at) in order: the step's rows start..end - 1 are rows at.. of a call of `rows` rows;
    `total` the step's rows. The AMX tile route gives them the order of oneDNN's call of that many rows."""

    def __init__(self, ranges: list[tuple[int, int, int, int]], total: int):
        self.ranges, self.total = ranges, total
        self._plans: dict[tuple[int, int], tuple] = {}

    def plan(self, kernel, outputs: int, inputs: int) -> tuple[torch.Tensor | None, list[tuple[int, int, int, int]]]:
        """For a weight [outputs, inputs]: each row's chunk for `amx_linear_out` (int32 [total]; 0 for the tiles'
        own order; None where every row's is), and the ranges whose call's order is none of those, which take
        `F.linear` itself. Made once a step for each shape."""
        plan = self._plans.get((outputs, inputs))
        if plan is None:
            chunks, left = torch.zeros(self.total, dtype=torch.int32), []
            for start, end, rows, at in self.ranges:
                chunk = onednn_chunk(kernel, rows, outputs, inputs)
                if chunk is None:
                    left.append((start, end, rows, at))
                elif chunk != inputs:   # (a chunk of every input is the tiles' own order)
                    chunks[start:end] = chunk
            plan = self._plans[(outputs, inputs)] = (chunks if bool(chunks.any()) else None, left)
        return plan


def onednn_chunk(kernel, rows: int, outputs: int, inputs: int) -> int | None:
    """The order of oneDNN's bfloat16 GEMM (`F.linear`) in a call of `rows` rows of a weight [outputs, inputs] on
    AMX tiles, as the chunk of inputs whose sums it adds: each chunk summed from zero in the tiles' order, the
    chunks' sums then added in order (`amx_linear`'s `chunk`; all the inputs where the call sums them in one
    accumulator). None where no chunk gives its bits (another order: such calls take `F.linear` itself).

    Found on the first call of each shape (and thread count) by trying every chunk of a multiple of 32 inputs that
    divides them against `F.linear` on random rows whose second half of inputs nearly cancels the first: the partial
    sums are then far larger than the result, and two orders of the sums give other bits on about one output in a
    hundred (one in ten thousand on plain random rows), so that a chunk that matches every output is the call's."""
    key = (rows, outputs, inputs, torch.get_num_threads())
    if key in _chunks:
        return _chunks[key]
    x, w, tiles = probe_data(kernel, rows, outputs, inputs)
    with torch.no_grad():
        theirs = F.linear(x, w)
    # the chunks found for other row counts of this weight shape first: a call's order changes with its rows
    # only now and then
    tried = [c for (_, o, i, _), c in _chunks.items() if (o, i) == (outputs, inputs) and c is not None]
    found = None
    for chunk in dict.fromkeys(tried + [c for c in range(inputs, 31, -32) if inputs % c == 0]):
        if torch.equal(kernel.amx_linear(x, tiles, chunk), theirs):
            found = chunk
            break
    _chunks[key] = found
    return found


def amx_tiles(kernel) -> bool:
    """Whether bfloat16 products above the codes' rows take the kernel's own AMX tile product (`amx_linear`): the
    build and the process have the tiles, and oneDNN sums its calls of a few rows in their order (`onednn_tile_order`),
    which that kernel keeps at every row count. PAGEDSERVE_AMX_LINEAR=0 leaves them to oneDNN's GEMM."""
    return os.environ.get("PAGEDSERVE_AMX_LINEAR", "1") != "0" and kernel is not None \
        and hasattr(kernel, "has_amx_linear") and kernel.has_amx_linear() and onednn_tile_order(kernel)


def bf16_dots_kernel(kernel) -> bool:
    """Whether bfloat16 products take the kernel's route in the order of torch's own GEMM: where oneDNN
    has no bfloat16 GEMM for the CPU (AVX2 only), `F.linear` in bfloat16 is that GEMM, one dot product
    per output and several times slower than float32 (pagedserve_kernels/cpu/bf16_dots_linear.cpp)."""
    return kernel is not None and kernel.vectorized() and hasattr(kernel, "bf16_dots_linear") \
        and not has_packed_bf16_gemm()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered once for its GEMM library (MKL for float32, oneDNN for bfloat16), or None."""
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT) \
            if has_packed_bf16_gemm() else None
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS_HINT) if has_packed_gemm() else None


class RoutedLinear:
    """y = x W^T + b for x [..., K], through the fastest route for its type and row count. `kernel` is
    the loaded CPU kernel module (or None), `packed` whether to pack W for its GEMM library, `codes`
    whether to read a float32 W as codes where its values allow it (exactly: see ops/quantized.py);
    for a bfloat16 W, the codes of the float32 weight it was rounded from (kept only if they give W
    back bit for bit), or None. `parts`: where W stacks several layers' weights (a layer's q, k and v), their
    output counts in order; a whole prompt's rows take each part as its own product (`own` in route)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel, packed: bool,
                 skinny_max_rows: int = SKINNY_MAX_ROWS, codes: bool | quantized.Codes | None = True,
                 parts: tuple[int, ...] | None = None):
        self.weight, self.bias = weight, bias
        self.kernel = kernel if bias is None else None   # the kernels add no bias
        wide = weight.dtype == torch.float32
        # where torch's own GEMM is F.linear's bfloat16 route, every row count takes the kernel that sums in
        # its order: its outputs are F.linear's, and the codes' or oneDNN's would not be; a few rows read
        # the weight's codes in that order, if the kernel's own expansion gives the weight back
        self.dots = self.kernel is not None and weight.dtype == torch.bfloat16 and weight.shape[1] % 64 == 0 \
            and bf16_dots_kernel(self.kernel)
        self.dots_codes = _dots_codes(self.kernel, codes, weight) if self.dots else None
        if self.dots or self.kernel is None or not codes or not self.kernel.has_coded_simd():
            # (torch's order reads them as dots_codes; or no vectorized codes kernel for this CPU: the float32
            # GEMM over the expanded weights is faster)
            self.codes = None
        elif wide:
            self.codes = quantized.find_codes(weight)
        else:
            self.codes = codes if weight.dtype == torch.bfloat16 and isinstance(codes, quantized.Codes) \
                and codes.rounds_to(self.kernel, weight) else None
        # a bfloat16 weight's codes in their plain layout (ops/greedy_head.py reads them), or None; with torch's
        # order, the Q8_0 codes the weight is the rounding of (an output layer's: the greedy head's)
        if self.dots:
            self.plain_codes = codes if self.dots_codes is not None and codes.kind == "q8_0" else None
        else:
            self.plain_codes = None if wide else self.codes
        # a float32 weight without codes, laid out once in the panels of the codes kernel's tiles, which then
        # serve every row count (where that kernel is vectorized); None elsewhere
        self.panel = kernel.panel_pack(weight.detach()) if packed and wide and self.codes is None \
            and self.kernel is not None and self.kernel.has_coded_simd() and weight.shape[0] % 16 == 0 else None
        # bfloat16 keeps a copy laid out for many rows beside the codes (for the AVX512-BF16 kernel where
        # it is the route, else oneDNN's); float32 codes and panels serve every row count
        many_rows = packed and (self.codes is None or not wide) and self.panel is None
        self.dot = kernel.bf16_pack(weight.detach()) if many_rows and not wide and self.kernel is not None \
            and bf16_dot_kernel(self.kernel) and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 else None
        # with AMX tiles, the kernel's own tile product in place of oneDNN's packed copy (the same layout as `dot`)
        out = weight.shape[0]
        bounds = [0]
        for count in parts or (out,):
            bounds.append(bounds[-1] + count)
        if bounds[-1] != out:
            raise ValueError(f"RoutedLinear: parts {parts} do not add up to the weight's {out} outputs")
        self.parts = list(zip(bounds, bounds[1:]))
        self.tiles = kernel.bf16_pack(weight.detach()) if many_rows and not wide and self.dot is None \
            and not self.dots and self.kernel is not None and all(b % 16 == 0 for b in bounds) \
            and weight.shape[1] % 32 == 0 and amx_tiles(self.kernel) else None
        self.packed = _pack(weight) if many_rows and self.dot is None and self.tiles is None and not self.dots else None
        # bfloat16 codes that only serve a few rows, where the build has the dot product: in its pair order
        if self.codes is not None and not wide and (self.dot is not None or self.packed is not None
                                                    or self.tiles is not None) \
                and self.kernel.has_bf16_dot():
            self.codes = self.codes.paired_order()
        # with AMX tiles, Q4_1 codes feed them as they go (amx_codes_linear: a few dozen rows are bound by reading
        # the weight, and the codes are a third of its bytes) where their expansion is the tiles' weight, bit for bit
        self.tile_codes = self.tiles is not None and self.codes is not None and self.codes.kind == "q4_1" \
            and self.codes.paired and self.kernel.has_amx_codes_linear() and torch.equal(
                self.kernel.amx_codes_expand(self.codes.codes, self.codes.scales, self.codes.mins).view(torch.int16),
                self.tiles.view(torch.int16))
        self.skinny_max_rows = skinny_max_rows
        # the route of each row count, chosen on its first call: routes differ only up to a few rows,
        # so every count from `rows_cap` on shares one entry
        self.rows_cap = 1 + max(BF16_CODES_MAX_ROWS, BF16_DOT_CODES_MAX_ROWS, DOTS_CODES_MAX_ROWS, skinny_max_rows)
        self._by_rows: dict[int, object] = {}

    @property
    def rows_apart(self) -> bool:
        """Whether a row's output has the same bits at every row count of a call, so that a call may leave
        rows out: the kernels' routes, each summing a row on its own in one order (float32 codes at every
        count; bfloat16's AVX512-BF16 kernel and its codes, both in oneDNN's order; the kernels in the order of
        torch's own GEMM). Not the few-row kernel against MKL's or oneDNN's GEMM above it."""
        if self.weight.dtype == torch.float32:
            return self.codes is not None or self.panel is not None
        return self.weight.dtype == torch.bfloat16 and (self.dots or self.dot is not None)

    @property
    def codes_max_rows(self) -> int:
        """The most rows a bfloat16 weight's codes serve: below its route for many rows (the AVX512-BF16
        kernel's layout, or oneDNN's packed GEMM); every count where it has neither."""
        if self.dot is not None:
            return BF16_DOT_CODES_MAX_ROWS
        return BF16_CODES_MAX_ROWS if self.packed is not None or self.tiles is not None else sys.maxsize

    @property
    def routed(self) -> bool:
        few_rows = self.kernel is not None and self.weight.dtype == torch.float32   # the few-row kernel
        return self.codes is not None or self.packed is not None or self.dot is not None or self.dots or few_rows \
            or self.tiles is not None

    def __call__(self, x: torch.Tensor, one_row: torch.Tensor | None = None, own=None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or x.dtype != self.weight.dtype or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        key = min(rows, self.rows_cap)
        route = self._by_rows.get(key)
        if route is None:
            route = self._by_rows[key] = self.route(key)
        out = route(x.reshape(rows, x.shape[-1]).contiguous(), one_row, own)
        return out.view(*x.shape[:-1], out.shape[-1])

    def route(self, rows: int):
        """The function f(x, one_row=None, own=None) that computes y [rows, N] from a contiguous x [rows, K] of the
        weight's type (gradients off) for this row count: the same route as a call, chosen once so that a
        forward calling every layer with the same rows skips the choice (llama_forward.py). `one_row`
        (bool [rows]): the rows that transformers computes in a call of one row, a generated token's;
        oneDNN's bfloat16 GEMM sums those in other chunks (pagedserve_kernels/cpu/simd.h), which the
        AVX512-BF16 kernels follow. `own` (OwnCalls): the rows that transformers computes in a call of more than
        TILE_CALL_ROWS rows (a prompt); the AMX tile route gives them the bits of `F.linear`'s call of that many
        rows, part by part (`parts`), and the other rows its tiles' sums. The other routes take every row as they
        take a call's."""
        weight, bias, kernel = self.weight, self.bias, self.kernel
        reads_codes = self.codes_route(rows)
        if reads_codes is not None:
            name, tensors = reads_codes
            product = getattr(kernel, name)
            if name == "bf16_dots_codes_linear":   # (torch's order has no one-row chunks)
                return lambda x, one_row=None, own=None: product(x, *tensors)
            return lambda x, one_row=None, own=None: product(x, *tensors, one_row)
        if weight.dtype == torch.bfloat16:
            wide = self.wide_route()
            if wide is not None:
                name, tensor = wide
                if name in ("amx_linear", "amx_codes_linear"):
                    return self._tiles_product
                if name == "bf16_dots_linear":   # (torch's order has no one-row chunks)
                    return lambda x, one_row=None, own=None: kernel.bf16_dots_linear(x, tensor)
                return lambda x, one_row=None, own=None: kernel.bf16_linear(x, tensor, one_row)
            if self.packed is not None:
                packed = self.packed
                return lambda x, one_row=None, own=None: \
                    torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return lambda x, one_row=None, own=None: F.linear(x, weight, bias)
        if self.panel is not None:
            panel, n = self.panel, weight.shape[0]
            return lambda x, one_row=None, own=None: kernel.panel_linear(x, panel, n)
        if kernel is not None and rows <= self.skinny_max_rows:
            return lambda x, one_row=None, own=None: kernel.skinny_linear(x, weight)
        if self.packed is not None:
            packed = self.packed
            return lambda x, one_row=None, own=None: _packed_gemm(x, packed, weight, bias, x.shape[0])
        return lambda x, one_row=None, own=None: F.linear(x, weight, bias)

    def _tiles_product(self, x: torch.Tensor, one_row=None, own: OwnCalls | None = None) -> torch.Tensor:
        """The AMX tile route (route's docstring): every row in the tiles' order but the `own` ones, each part of
        those in the order of oneDNN's call of as many rows as transformers' (`onednn_chunk`), by the tiles where
        that order is chunks of the inputs, else from `F.linear`'s call itself; written into one output."""
        kernel, tiles, weight = self.kernel, self.tiles, self.weight
        if own is not None:
            plans = [own.plan(kernel, hi - lo, x.shape[1]) for lo, hi in self.parts]
        if own is None or all(chunks is None and not left for chunks, left in plans):
            if self.tile_codes:
                codes = self.codes
                return kernel.amx_codes_linear(x, codes.codes, codes.scales, codes.mins)
            return kernel.amx_linear(x, tiles)
        y = x.new_empty((x.shape[0], weight.shape[0]))
        # parts of one shape have one plan (a layer's gate and up, its k and v): one call for neighbours
        spans = []
        for (lo, hi), plan in zip(self.parts, plans):
            if spans and spans[-1][2] is plan:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi, plan])
        for lo, hi, (chunks, left) in spans:
            kernel.amx_linear_out(x, tiles[lo // 16:hi // 16], y[:, lo:hi], 0, chunks)
            for start, end, rows, at in left:
                call = x[start:end]
                if rows != end - start:   # (a row's products do not depend on the other rows' values)
                    call = x.new_zeros((rows, x.shape[1]))
                    call[at:at + end - start] = x[start:end]
                y[start:end, lo:hi] = F.linear(call, weight[lo:hi])[at:at + end - start]
        return y

    def wide_route(self) -> tuple[str, torch.Tensor] | None:
        """Where a bfloat16 weight's call of more rows than its codes serve goes to one of the kernel's own
        products (one of WIDE_KERNELS, and the weight tensor it takes after x); else None (oneDNN's GEMM, or a
        float32 weight). route() and the layers in one call (llama_forward.py) both take it from here; the AMX
        tiles' route takes `amx_linear` for the rows of a step without long prompts (`own` None, the only steps
        the layers' one call takes), or `amx_codes_linear` on the codes where they feed the tiles, and
        `_tiles_product` for the others."""
        if self.weight.dtype != torch.bfloat16 or self.kernel is None:
            return None
        if self.dots:
            return "bf16_dots_linear", self.weight
        if self.tiles is not None:   # (the codes' tiles take the product's codes: no tensor of their own)
            return ("amx_codes_linear", None) if self.tile_codes else ("amx_linear", self.tiles)
        return ("bf16_linear", self.dot) if self.dot is not None else None

    def codes_route(self, rows: int) -> tuple[str, tuple] | None:
        """Where a call of `rows` rows reads the weight's codes: (the kernel function's name, one of
        CODES_KERNELS, and the tensors it takes after x); else None. The layers in one call
        (llama_forward.py) take the same."""
        codes = self.codes
        if self.weight.dtype == torch.bfloat16:
            if self.dots:
                if self.dots_codes is not None and rows <= DOTS_CODES_MAX_ROWS:
                    return "bf16_dots_codes_linear", self.dots_codes
                return None
            if codes is None or rows > self.codes_max_rows:
                return None
        elif codes is None:
            return None
        return codes.kernel_name, (codes.codes, codes.scales, codes.mins)


def _dots_codes(kernel, codes, weight: torch.Tensor):
    """A bfloat16 weight's GGUF codes (`codes`, when they are quantized.Codes) laid out row by row for
    `bf16_dots_codes_linear` (codes, scale_min), if the kernel's own expansion and rounding give the
    weight back bit for bit; else None."""
    if not isinstance(codes, quantized.Codes):
        return None
    row_codes, scale_min = codes.row_blocks()
    same = torch.equal(kernel.bf16_dots_codes_expand(row_codes, scale_min).view(torch.int16),
                       weight.detach().view(torch.int16))
    return (row_codes, scale_min) if same else None


def routed_in(model: torch.nn.Module) -> list[RoutedLinear]:
    """The RoutedLinear that route_linears set as `model`'s layers' forward."""
    return [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), RoutedLinear)]


def warm_up(linears, rows: int = WARM_ROWS) -> int:
    """Runs the route of every row count from 1 to `rows` once for each distinct bfloat16 weight (shape,
    bias or none) among the RoutedLinear `linears` that has oneDNN's packed copy, on zeros: oneDNN's
    kernels for those row counts are then generated before a step needs them. Returns the calls made."""
    seen, calls = set(), 0
    for lin in linears:
        key = (tuple(lin.weight.shape), lin.bias is None)
        if lin.packed is None or lin.weight.dtype != torch.bfloat16 or key in seen:
            continue
        seen.add(key)
        x = torch.zeros(rows, lin.weight.shape[1], dtype=lin.weight.dtype)
        with torch.no_grad():
            for count in range(1, rows + 1):
                lin.route(count)(x[:count])
                calls += 1
    return calls


ROUTED_DTYPES = (torch.float32, torch.bfloat16)


def eligible(weight: torch.Tensor) -> bool:
    return weight.dtype in ROUTED_DTYPES and weight.device.type == "cpu" and weight.is_contiguous()


def kernel_for(weights) -> object | None:
    """The CPU kernel module when some of `weights` can use it (no build at all for a GPU model)."""
    return cpu_kernels.load() if any(eligible(w) for w in weights) else None


def route_linears(model: torch.nn.Module, skinny_max_rows: int = SKINNY_MAX_ROWS,
                  packed: bool | None = None, codes: bool | dict = True) -> dict[str, int]:
    """Route the float32 and bfloat16 CPU `nn.Linear` layers of `model`: float32 ones through the kernel
    reading codes (`codes`, where a weight is exactly GGUF codes expanded), else its panels (`packed`), else
    the few-row kernel (up to `skinny_max_rows` rows) and the packed GEMM; bfloat16 ones through oneDNN's packed GEMM (`packed`:
    None uses packing where the library has it), reading codes where `codes` (a dict from module to
    the codes found before the model was narrowed: ops/quantized.codes_by_module) gives them; returns
    how many layers each route took over (0 each when none is available). Calling it again re-routes."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and eligible(m.weight)]
    kernel = kernel_for([m.weight for m in layers if m.bias is None])
    packed = True if packed is None else packed
    taken = []
    for module in layers:
        given = codes.get(module) if isinstance(codes, dict) else codes
        routed = RoutedLinear(module.weight, module.bias, kernel, packed, skinny_max_rows, given)
        if routed.routed:
            module.forward = routed   # instance attribute: hooks still run
            taken.append(routed)
    if any(r.weight.dtype == torch.bfloat16 and r.codes is not None and r.packed is not None for r in taken):
        onednn_tile_order(kernel)   # (oneDNN's GEMM above the codes' rows: their sums in its order, where it has one)
    return route_counts(taken)


def route_counts(linears) -> dict[str, int]:
    """How many of the RoutedLinear `linears` read codes, read float32 panels (every row count), take the
    few-row kernel (float32 weights with neither; they take the packed GEMM above its rows too) and have a
    weight laid out for a GEMM (oneDNN's or the AVX512-BF16 kernel's), and take bfloat16 products in the
    order of torch's own GEMM."""
    counts = {"codes": 0, "panels": 0, "kernel": 0, "packed": 0, "dots": 0}
    for routed in linears:
        counts["codes"] += routed.codes is not None or routed.dots_codes is not None
        counts["panels"] += routed.panel is not None
        counts["kernel"] += routed.kernel is not None and routed.codes is None and routed.panel is None \
            and routed.weight.dtype == torch.float32
        counts["packed"] += routed.packed is not None or routed.dot is not None or routed.tiles is not None
        counts["dots"] += routed.dots
    return counts
