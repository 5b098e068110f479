"""Float32 linear layers on CPU, routed by the number of rows a step brings:

- a weight whose float32 values are exactly GGUF Q4_1 or Q8_0 codes expanded (as the default model's
  are; ops/quantized.py finds them) goes through the kernel that reads the codes
  (kernels/cpu/coded_linear.cpp) at every row count: over all of SmolLM2's Q4_1 layers it was 2.2x
  the routes below at 1 row, 2.0x at 16, 1.3x at 64 and 1.06x at 512;
- else, 1..SKINNY_MAX_ROWS rows: the few-row kernel (kernels/cpu/skinny_linear.cpp), which streams each
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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ops import cpu_kernels, quantized

# measured on the runner's decode step, alternating (quiet machine): the kernel is even with the packed GEMM
# up to 12 rows and 7% slower at 16; the packed GEMM is 1.10-1.14x F.linear at 32-64 rows
SKINNY_MAX_ROWS = 8
PACK_ROWS_HINT = 64   # the row count the weight is packed for; see the module's docstring


def _packed_gemm(x, packed, weight, bias, rows):
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def has_packed_gemm() -> bool:
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


class RoutedLinear:
    """y = x W^T + b for x [..., K], through the fastest route for its row count. `kernel` is the
    loaded CPU kernel module (or None), `packed` whether to pack W for MKL's GEMM, `codes` whether
    to read W as codes where its values allow it (exactly: see ops/quantized.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel, packed: bool,
                 skinny_max_rows: int = SKINNY_MAX_ROWS, codes: bool = True):
        self.weight, self.bias = weight, bias
        self.kernel = kernel if bias is None else None   # the kernels add no bias
        self.codes = quantized.find_codes(weight) if codes and self.kernel is not None else None
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS_HINT) \
            if packed and has_packed_gemm() and self.codes is None else None
        self.skinny_max_rows = skinny_max_rows

    @property
    def routed(self) -> bool:
        return self.kernel is not None or self.packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if self.codes is not None:
            out = self.codes.linear(self.kernel, flat.contiguous())
        elif self.kernel is not None and rows <= self.skinny_max_rows:
            out = self.kernel.skinny_linear(flat.contiguous(), self.weight)
        elif self.packed is not None:
            out = _packed_gemm(flat, self.packed, self.weight, self.bias, rows)
        else:
            out = F.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def eligible(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def kernel_for(weights) -> object | None:
    """The CPU kernel module when some of `weights` can use it (no build at all for a GPU or bf16 model)."""
    return cpu_kernels.load() if any(eligible(w) for w in weights) else None


def route_linears(model: torch.nn.Module, skinny_max_rows: int = SKINNY_MAX_ROWS,
                  packed: bool | None = None, codes: bool = True) -> dict[str, int]:
    """Route the float32 CPU `nn.Linear` layers of `model` through the kernel reading codes (`codes`,
    where a weight is exactly GGUF codes expanded), the few-row kernel (up to `skinny_max_rows` rows) and
    the packed GEMM (`packed`: None uses it where MKL has it); returns how many layers each route took
    over (0 each when none is available). Calling it again re-routes."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and eligible(m.weight)]
    kernel = kernel_for([m.weight for m in layers if m.bias is None])
    packed = has_packed_gemm() if packed is None else packed
    taken = []
    for module in layers:
        routed = RoutedLinear(module.weight, module.bias, kernel, packed, skinny_max_rows, codes)
        if routed.routed:
            module.forward = routed   # instance attribute: hooks still run
            taken.append(routed)
    return route_counts(taken)


def route_counts(linears) -> dict[str, int]:
    """How many of the RoutedLinear `linears` read codes, take the few-row kernel (those without
    codes; they take the packed GEMM above its rows too) and have a packed GEMM weight."""
    counts = {"codes": 0, "kernel": 0, "packed": 0}
    for routed in linears:
        counts["codes"] += routed.codes is not None
        counts["kernel"] += routed.kernel is not None and routed.codes is None
        counts["packed"] += routed.packed is not None
    return counts
