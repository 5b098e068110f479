"""Float32 weights that are exactly small integer codes with a scale (and minimum) per 32 inputs.

A model loaded from a GGUF file is expanded by transformers to float32. The default model's file
holds its linear layers in Q4_1 and its embedding (tied to the output layer) in Q8_0:
- Q4_1: every block of 32 weights in a row is `scale * code + min`, code in 0..15, scale and min
  float16, rounded in float32 after the product and after the sum;
- Q8_0: `scale * code`, code in -128..127, scale float16.
The model is then served in float32, but its weights carry 5 or 8.5 bits of information each, not 32.
`find_codes` recovers the codes from the float32 values alone (no GGUF parsing: it works for any
layer whose values have that form, and row permutations such as transformers' Q/K reordering do not
matter) and keeps them only if they give back every weight bit for bit. The kernel
(pagedserve_kernels/cpu/coded_linear.cpp) then reads the codes instead of the float32 weights: a step of a few
rows is bound by reading the weights from memory, and these are 6.4 (Q4_1) and 3.8 (Q8_0) times
smaller (5 and 8.5 bits a weight: the scales and minimums stay float16, as in the file, since every one
found is a float16 value). The products are float32 arithmetic on the same float32 weights.

How the codes are found, per block of 32. llama.cpp's quantizers store
- Q4_1: min = the block's minimum and scale = (max - min) / 15, both rounded to float16, so code 0
  gives the minimum back exactly;
- Q8_0: scale = max |w| / 127 rounded to float16.
The scale is the float16 value nearest that estimate or one of its neighbours: each candidate is
tried, and a block is found when every one of its 32 weights comes back with the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 16          # output rows per group of the kernel's layout
BLOCK = 32          # inputs per scale (and minimum)
_SCALE_STEPS = (0, -1, 1, -2, 2)   # float16 neighbours of the estimated scale, tried in this order


@dataclass
class Codes:
    """The packed codes of one [N, K] weight, in the layout pagedserve_kernels/cpu/coded_linear.cpp reads."""
    kind: str                    # "q4_1" or "q8_0"
    codes: torch.Tensor          # q4_1: uint8 [N / 16, K / 2, 16]; q8_0: int8 [N / 16, K, 16]
    scales: torch.Tensor         # float16 [N / 16, K / 32, 16]
    mins: torch.Tensor | None    # q4_1: float16 [N / 16, K / 32, 16]; q8_0: None
    paired: bool = False         # codes in the pair order (see `paired_order`)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    @property
    def kernel_name(self) -> str:
        """The name of the kernel function that reads these codes: f(x, codes, scales, mins, one_row=None)."""
        return "coded_pairs_linear" if self.paired else "coded_linear"

    def product(self, kernel):
        """The kernel's function that reads these codes (kernel_name)."""
        return getattr(kernel, self.kernel_name)

    def linear(self, kernel, x: torch.Tensor) -> torch.Tensor:
        return self.product(kernel)(x, self.codes, self.scales, self.mins)

    def paired_order(self) -> Codes:
        """The same codes laid out for the AVX512-BF16 dot product (`coded_pairs_linear`, 1-4 bfloat16
        rows), which multiplies a row's two inputs 2j and 2j + 1 in one lane: per group and input pair,
        the 16 lanes are rows 0-7 of the group, then rows 8-15, with a row's two inputs side by side
        (lane 2r + e: row r, input 2j + e). Q4_1 keeps rows 0-7 in the low nibbles and rows 8-15 in the
        high ones of one 16-byte line; Q8_0 has rows 0-7 in the first of its two lines and 8-15 in the
        second. The kernel's expansion then comes out in the order the dot product takes, where the
        plain layout needs a permutation per pair of inputs. Same values, same results."""
        if self.paired:
            return self
        groups, lines, lanes = self.codes.shape
        with torch.no_grad():
            if self.kind == "q4_1":
                # [groups, K / 2, 16 rows, 2 inputs] -> [groups, K / 2, 2 halves, 8 rows, 2 inputs]
                nibbles = torch.stack((self.codes & 15, self.codes >> 4), dim=-1).view(groups, lines, 2, 8, 2)
                codes = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(groups, lines, lanes)
            else:
                # [groups, K / 2, 2 inputs, 16 rows] -> [groups, K / 2, 16 rows, 2 inputs]: halves of 8 rows
                codes = self.codes.view(groups, lines // 2, 2, lanes).transpose(2, 3).reshape(groups, lines, lanes)
        return Codes(self.kind, codes.contiguous(), self.scales, self.mins, paired=True)

    def plain_order(self) -> Codes:
        """The codes back in the plain layout (coded_linear's, for every row count): paired_order undone."""
        if not self.paired:
            return self
        groups, lines, lanes = self.codes.shape
        with torch.no_grad():
            if self.kind == "q4_1":
                # [groups, K / 2, 8 rows, 2 inputs, 2 halves] -> [groups, K / 2, 2 halves, 8 rows, 2 inputs]
                nibbles = torch.stack((self.codes & 15, self.codes >> 4), dim=-1).view(groups, lines, 8, 2, 2)
                nibbles = nibbles.permute(0, 1, 4, 2, 3).reshape(groups, lines, lanes, 2)
                codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
            else:
                codes = self.codes.view(groups, lines // 2, lanes, 2).transpose(2, 3).reshape(groups, lines, lanes)
        return Codes(self.kind, codes.contiguous(), self.scales, self.mins)

    def row_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes row by row in GGUF's own block layout, for `bf16_dots_codes_linear`
        (pagedserve_kernels/cpu/bf16_dots_linear.cpp), and each block's scale (and minimum) as float32
        [N, K / 32, 2] (Q4_1) or [N, K / 32, 1] (Q8_0), exact since they are float16 values. Q4_1: uint8
        [N, K / 2], the 16 bytes of block b of row n holding inputs 32 b + j (low nibble) and 32 b + 16 + j
        (high nibble) in byte j; Q8_0: int8 [N, K]."""
        plain = self.plain_order()
        groups, lines, lanes = plain.codes.shape
        n = groups * lanes
        with torch.no_grad():
            if self.kind == "q4_1":
                # [groups, K / 2, 16 rows] bytes of inputs (2j, 2j + 1) -> [N, K] codes -> GGUF's blocks
                k = lines * 2
                codes = torch.stack((plain.codes & 15, plain.codes >> 4), dim=-1).permute(0, 2, 1, 3).reshape(n, k)
                halves = codes.view(n, k // BLOCK, 2, BLOCK // 2)
                rows = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
            else:
                k = lines   # [groups, K, 16 rows]
                rows = plain.codes.permute(0, 2, 1).reshape(n, k)

            def by_row(t: torch.Tensor) -> torch.Tensor:   # [groups, K / 32, 16] -> [N, K / 32]
                return t.permute(0, 2, 1).reshape(n, k // BLOCK).float()
            parts = [plain.scales] + ([plain.mins] if self.kind == "q4_1" else [])
            scale_min = torch.stack([by_row(t) for t in parts], dim=-1)
        return rows.contiguous(), scale_min.contiguous()

    @staticmethod
    def cat(parts: list[Codes | None]) -> Codes | None:
        """The codes of the weights stacked along their outputs (each a whole number of groups), or None
        when some part has none or the formats differ."""
        if not parts or any(p is None or (p.kind, p.paired) != (parts[0].kind, parts[0].paired) for p in parts):
            return None
        mins = torch.cat([p.mins for p in parts]) if parts[0].mins is not None else None
        return Codes(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins,
                     parts[0].paired)

    def rounds_to(self, kernel, weight: torch.Tensor) -> bool:
        """Whether these codes, expanded to float32 and rounded to bfloat16, give the bfloat16 `weight`
        bit for bit (a bfloat16 model cast from the float32 one the codes were found in)."""
        if self.paired:
            raise ValueError("rounds_to reads codes in the plain layout")
        wide = kernel.coded_expand(self.codes, self.scales, self.mins)
        return wide.shape == weight.shape and \
            torch.equal(wide.to(torch.bfloat16).view(torch.int16), weight.detach().view(torch.int16))


def find_codes(weight: torch.Tensor) -> Codes | None:
    """The codes of `weight` [N, K] in the first format that gives it back exactly, or None (also
    when its shape does not fit the kernel: N a multiple of 16, K of 32)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if n == 0 or n % GROUP or k == 0 or k % BLOCK:
        return None
    with torch.no_grad():
        blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
        # the first group of rows first: a weight of neither form (most float32 models') is turned down
        # after a search over 16 rows, not over all of them
        for find in (_find_q4_1, _find_q8_0):
            first = find(blocks[:GROUP])
            if first is not None:
                return first if n == GROUP else find(blocks)
        return None


def codes_by_module(model: torch.nn.Module) -> dict[torch.nn.Module, Codes]:
    """The codes of every float32 `nn.Linear` weight of `model` that has them: found before a model is
    narrowed to bfloat16, where the float32 values are gone (the bfloat16 path reads them through
    `Codes.rounds_to`)."""
    found = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            codes = find_codes(module.weight)
            if codes is not None:
                found[module] = codes
    return found


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per block: every value of `a` has the bits of `b` (-0.0 and 0.0 differ)."""
    return (a.view(torch.int32) == b.view(torch.int32)).all(-1, keepdim=True)


def _search(blocks, estimate, expand, code_of):
    """Per block, the first float16 scale near `estimate` whose codes `expand` back to the block;
    (scales, codes) or None when some block has none."""
    estimate_bits = estimate.half().view(torch.int16)
    found = torch.zeros(estimate.shape, dtype=torch.bool)
    scales, codes = torch.zeros_like(estimate), torch.zeros_like(blocks)
    for step in _SCALE_STEPS:
        scale = (estimate_bits + step).view(torch.float16).float()
        scale = torch.where(torch.isfinite(scale) & (scale >= 0), scale, torch.zeros_like(scale))
        code = code_of(scale) + 0.0   # integer codes: no -0.0 (GGUF's int8 0 expands to +0.0)
        exact = _same_bits(expand(scale, code), blocks) & ~found
        scales, codes = torch.where(exact, scale, scales), torch.where(exact, code, codes)
        found |= exact
        if bool(found.all()):
            return scales, codes
    return None


def _find_q4_1(blocks: torch.Tensor) -> Codes | None:
    if not torch.isfinite(blocks).all():
        return None
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    if not torch.equal(low.half().float(), low):
        return None
    found = _search(blocks, (high - low) / 15, lambda scale, code: scale * code + low,
                    lambda scale: torch.where(scale > 0, (blocks - low) / scale, 0.0).round_().clamp_(0, 15))
    if found is None:
        return None
    n, nb = blocks.shape[:2]
    scales, codes = found
    codes = codes.to(torch.uint8).reshape(n, nb * BLOCK)
    pairs = codes.reshape(n // GROUP, GROUP, nb * BLOCK // 2, 2).permute(0, 2, 1, 3)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return Codes("q4_1", packed, _by_group(scales), _by_group(low))


def _find_q8_0(blocks: torch.Tensor) -> Codes | None:
    if not torch.isfinite(blocks).all():
        return None
    found = _search(blocks, blocks.abs().amax(-1, keepdim=True) / 127, lambda scale, code: scale * code,
                    lambda scale: torch.where(scale > 0, blocks / scale, 0.0).round_().clamp_(-128, 127))
    if found is None:
        return None
    n, nb = blocks.shape[:2]
    scales, codes = found
    codes = codes.to(torch.int8).reshape(n // GROUP, GROUP, nb * BLOCK).transpose(1, 2).contiguous()
    return Codes("q8_0", codes, _by_group(scales), None)


def _by_group(t: torch.Tensor) -> torch.Tensor:
    """[N, K / 32, 1] per-block float32 values, each a float16 value (the search's candidates, Q4_1's
    checked minimum), into the kernel's float16 [N / 16, K / 32, 16]: the conversion is exact."""
    n, nb = t.shape[:2]
    return t.reshape(n // GROUP, GROUP, nb).transpose(1, 2).half().contiguous()
