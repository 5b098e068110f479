"""The greedy token of rows that want nothing else, without their 49,152 logits.

A greedy row whose request asked for no log-probs needs only the first index of its largest logit. When
the output layer is float32 GGUF Q8_0 codes (the default model's tied embedding), the kernel
pagedserve_kernels/cpu/greedy_head.cpp finds it from an integer first pass with a proven error bound and the exact
logits of the few outputs that bound leaves in the running: the token, and its logit, have the bits the
full product gives. Needs AVX512-VNNI (`has_q8_argmax`); elsewhere, and with PAGEDSERVE_GREEDY_HEAD=0,
every row takes the full logits.
"""
from __future__ import annotations

import os

import torch

from ops import quantized


# Fewer rows than this take the full logits: up to 4 rows the full product is coded_linear's few-row path,
# bound by reading the layer's 28 MiB, which the first pass reads as well (bench/greedy_head.py: no gain
# at 1-4 rows, about half the time from 6 on)
MIN_ROWS = 5


class GreedyHead:
    """The output layer's codes laid out for the kernel's first pass, beside the codes it recomputes from."""

    def __init__(self, kernel, codes: quantized.Codes):
        self.kernel, self.codes = kernel, codes
        groups, k, lanes = codes.codes.shape
        # [N / 16, K / 4, 16, 4]: per group and four inputs, each row's four codes in one 32-bit lane,
        # plus 128 (the first pass multiplies unsigned bytes by the signed ones of x)
        self.packed = (codes.codes.view(groups, k // 4, 4, lanes).permute(0, 1, 3, 2).to(torch.int16) + 128) \
            .to(torch.uint8).contiguous()
        # per row and block of 32 inputs, |scale| * sum |code|: the bound's weight of that block's error
        blocks = codes.codes.view(groups, k // quantized.BLOCK, quantized.BLOCK, lanes)
        self.absums = (blocks.to(torch.int32).abs().sum(2).float() * codes.scales.float().abs()).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.absums.numel() * 4

    def tokens(self, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per row of float32 hidden [rows, K]: its greedy token (-1 where a value is not finite: that
        row needs the full logits), and how many logits were computed exactly."""
        tokens, _, counts = self.kernel.q8_argmax(hidden.contiguous(), self.packed, self.codes.codes,
                                                  self.codes.scales, self.absums)
        return tokens.tolist(), counts.tolist()


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_GREEDY_HEAD", "1") != "0"


def build(head: torch.nn.Module, kernel) -> GreedyHead | None:
    """A GreedyHead for the output layer `head` when its float32 CPU weight is Q8_0 codes and the kernel
    has the first pass, else None."""
    weight = getattr(head, "weight", None)
    if not enabled() or kernel is None or not kernel.has_q8_argmax() or getattr(head, "bias", None) is not None \
            or weight is None or weight.dtype != torch.float32:
        return None
    routed = head.__dict__.get("forward")   # ops/linear.py's route keeps the codes it found
    codes = getattr(routed, "codes", None)
    if codes is None:
        codes = quantized.find_codes(weight)
    return GreedyHead(kernel, codes) if codes is not None and codes.kind == "q8_0" else None
