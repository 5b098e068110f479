"""The greedy token of rows that want nothing else, without their 49,152 logits.

A greedy row whose request asked for no log-probs needs only the first index of its largest logit. When
the output layer is float32 GGUF Q8_0 codes (the default model's tied embedding), the kernel
pagedserve_kernels/cpu/greedy_head.cpp finds it from an integer first pass with a proven error bound and the exact
logits of the few outputs that bound leaves in the running: the token, and its logit, have the bits the
full product gives. Needs AVX512-VNNI or AVX2 (`has_q8_argmax`, `q8_argmax_kind`); elsewhere, and with
PAGEDSERVE_GREEDY_HEAD=0, every row takes the full logits.

A bfloat16 output layer rounded from such codes takes the same first pass (its bound widened by the
rounding) where its products are the AVX512-BF16 kernel's (ops/linear.py): the candidates' logits are then
computed as that kernel computes them and rounded to bfloat16, and the token is the first index of the
largest of those, as the sampler takes it from the full bfloat16 logits (`has_bf16_argmax`).
"""
from __future__ import annotations

import os

import torch

from ops import quantized


# Fewer rows than this, by the kernel's first pass, take the full logits: there the full product is
# coded_linear's few-row path, bound by reading the layer's 28 MiB, which the first pass reads as well
# (bench/greedy_head.py). AVX512-VNNI: no gain at 1-4 rows. AVX2 (two instructions for VNNI's one, and a
# wider bound): no gain up to 8 rows, where the full product keeps its weights in registers.
MIN_ROWS = {"avx512_vnni": 5, "avx2": 9}


NORM_GROUPS = 256   # groups of 16 rows a time: their float64 weights a few MB, where a whole layer's are hundreds


def _norms_up(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Euclidean norms of blocks of weights scale * code, codes [G, B, 32, 16] and scales [G, B, 16]:
    in float64 (each weight exact there, as in float32), then rounded up to float32, so that the bound they
    weigh is never less than the real one."""
    norms = (codes.double() * scales.double()[:, :, None, :]).pow(2).sum(2).sqrt()
    rounded = norms.float()
    return torch.where(rounded.double() < norms, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


class GreedyHead:
    """The output layer's codes laid out for the kernel's first pass, beside the codes it recomputes from."""

    def __init__(self, kernel, codes: quantized.Codes, weight: torch.Tensor | None = None):
        self.kernel, self.codes = kernel, codes
        self.weight = weight   # bfloat16 [N, K], the codes' rounding: the logits that decide are its (or None)
        self.kind = kernel.q8_argmax_kind()
        self.min_rows = MIN_ROWS[self.kind]   # a step's greedy rows it serves, at least
        groups, k, lanes = codes.codes.shape
        # [N / 16, K / 4, 16, 4]: per group and four inputs, each row's four codes in one 32-bit lane,
        # plus 128 (the first pass multiplies unsigned bytes by the signed ones of x)
        self.packed = (codes.codes.view(groups, k // 4, 4, lanes).permute(0, 1, 3, 2).to(torch.int16) + 128) \
            .to(torch.uint8).contiguous()
        # per row and block of 32 inputs, |scale| * sum |code|: the weight of the bound's share for float rounding
        blocks = codes.codes.view(groups, k // quantized.BLOCK, quantized.BLOCK, lanes)
        self.absums = (blocks.to(torch.int32).abs().sum(2).float() * codes.scales.float().abs()).contiguous()
        # per row and block, the Euclidean norm of its weights: the bound's weight of x's rounding
        self.norms = torch.empty_like(self.absums)
        for g in range(0, groups, NORM_GROUPS):
            self.norms[g:g + NORM_GROUPS] = _norms_up(blocks[g:g + NORM_GROUPS], codes.scales[g:g + NORM_GROUPS])
        # per group of 16 outputs and block, the largest norm and absum of its outputs: the group's widest bound
        self.widest = torch.stack([self.norms.amax(2), self.absums.amax(2)], 1).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + (self.absums.numel() + self.norms.numel() + self.widest.numel()) * 4

    def tokens(self, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per row of hidden [rows, K] (the output layer's type): its greedy token (-1 where a value is not
        finite, or for bfloat16 too small: that row needs the full logits), and how many logits were computed
        exactly."""
        tokens, _, counts = self.kernel.q8_argmax(hidden.float().contiguous(), self.packed, self.codes.codes,
                                                  self.codes.scales, self.absums, self.norms, self.widest, self.weight)
        return tokens.tolist(), counts.tolist()


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_GREEDY_HEAD", "1") != "0"


def build(head: torch.nn.Module, kernel) -> GreedyHead | None:
    """A GreedyHead for the output layer `head` when its CPU weight is Q8_0 codes (float32), or their
    rounding to bfloat16 with the AVX512-BF16 kernel as its route, and the kernel has the first pass, else
    None."""
    weight = getattr(head, "weight", None)
    if not enabled() or kernel is None or not kernel.has_q8_argmax() or getattr(head, "bias", None) is not None \
            or weight is None or weight.device.type != "cpu":
        return None
    routed = head.__dict__.get("forward")   # ops/linear.py's route keeps the codes it found
    if weight.dtype == torch.bfloat16:
        # the exact logits are the AVX512-BF16 kernel's (bf16_linear: `dot` is its layout), whose bits every row
        # count of the route gives; the codes those of the float32 weight it was rounded from
        if not kernel.has_bf16_argmax() or getattr(routed, "dot", None) is None:
            return None
        codes = routed.plain_codes
        return GreedyHead(kernel, codes, weight.detach().contiguous()) \
            if codes is not None and codes.kind == "q8_0" else None
    if weight.dtype != torch.float32:
        return None
    codes = getattr(routed, "codes", None)
    if codes is None:
        codes = quantized.find_codes(weight)
    return GreedyHead(kernel, codes) if codes is not None and codes.kind == "q8_0" else None
