"""Float32 weights that are exactly 4-bit codes with a scale and a minimum per 32 inputs.

A model loaded from a GGUF file in Q4_1 (the default model) is expanded by transformers to float32:
every block of 32 weights in a row is `scale * code + min`, code in 0..15, scale and min float16,
rounded in float32 after the product and after the sum. The model is then served in float32, but
its weights carry 5 bits of information each, not 32. `find_q4_codes` recovers the codes from the
float32 values alone (no GGUF parsing: it works for any layer whose values have that form, and row
permutations such as transformers' Q/K reordering do not matter) and keeps them only if they give
back every weight bit for bit. The kernel (kernels/cpu/q4_linear.cpp) then reads the codes instead
of the float32 weights: a step of a few rows is bound by reading the weights from memory, and these
are 6.4 times smaller. The products are the same float32 arithmetic on the same float32 weights.

How the codes are found, per block of 32: llama.cpp's Q4_1 quantizer stores min = the block's
minimum and scale = (max - min) / 15, both rounded to float16, so code 0 gives the minimum back
exactly and the scale is the float16 value nearest (max - min) / 15 or one of its neighbours. Each
candidate scale is tried; a block is found when every one of its 32 weights comes back exactly.
"""
from __future__ import annotations

import torch

GROUP = 16          # output rows per group of the kernel's layout
BLOCK = 32          # inputs per scale and minimum
_SCALE_STEPS = (0, -1, 1, -2, 2)   # float16 neighbours of the estimated scale, tried in this order


class Q4Codes:
    """The packed codes of one [N, K] weight, in the layout kernels/cpu/q4_linear.cpp reads."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
        self.codes, self.scales, self.mins = codes, scales, mins

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))


def find_q4_codes(weight: torch.Tensor) -> Q4Codes | None:
    """The codes of `weight` [N, K], or None when it is not exactly of the Q4_1 form (or its shape
    does not fit the kernel: N a multiple of 16, K of 32)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if n == 0 or n % GROUP or k == 0 or k % BLOCK:
        return None
    with torch.no_grad():
        blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        if not torch.isfinite(low).all() or not torch.isfinite(high).all() \
                or not torch.equal(low.half().float(), low):
            return None
        estimate_bits = ((high - low) / 15).half().view(torch.int16)
        found = torch.zeros(low.shape, dtype=torch.bool)
        scales = torch.zeros_like(low)
        codes = torch.zeros(blocks.shape, dtype=torch.uint8)
        for step in _SCALE_STEPS:
            scale = (estimate_bits + step).view(torch.float16).float()
            scale = torch.where(torch.isfinite(scale) & (scale >= 0), scale, torch.zeros_like(scale))
            code = torch.where(scale > 0, (blocks - low) / scale, torch.zeros_like(blocks)).round_().clamp_(0, 15)
            exact = ((scale * code + low) == blocks).all(-1, keepdim=True) & ~found
            scales = torch.where(exact, scale, scales)
            codes = torch.where(exact, code.to(torch.uint8), codes)
            found |= exact
            if bool(found.all()):
                return _pack(codes.reshape(n, k), scales.reshape(n, k // BLOCK), low.reshape(n, k // BLOCK))
    return None


def _pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Codes:
    """codes [N, K] (0..15), scales and mins [N, K / 32] into the kernel's layout (see its header)."""
    n, k = codes.shape
    pairs = codes.reshape(n // GROUP, GROUP, k // 2, 2).permute(0, 2, 1, 3)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    def by_group(t):
        return t.reshape(n // GROUP, GROUP, k // BLOCK).transpose(1, 2).contiguous()
    return Q4Codes(packed, by_group(scales), by_group(mins))
