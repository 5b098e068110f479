"""The greedy token of rows that want nothing else, without their 49,152 logits.

A greedy row whose request asked for no log-probs needs only the first index of its largest logit. When
the output layer is float32 GGUF Q8_0 codes (the default model's tied embedding), the kernel
kernels/cpu/greedy_head.cpp finds it from an integer first pass with a proven error bound and the exact
logits of the few outputs that bound leaves in the running: the token, and its logit, have the bits the
full product gives. Needs AVX512-VNNI (`has_q8_argmax`); elsewhere, and with PAGEDSERVE_GREEDY_HEAD=0,
every row takes the full logits.

A bfloat16 output layer whose weights are those codes rounded to bfloat16 (a GGUF model served in
bfloat16) takes the same first pass with a margin that also covers the weights' rounding and the float32
sum, and a slack for logits that round to the same bfloat16 value as the largest (a tie, which the first
index wins); the few candidates' logits are then computed by `F.linear` on their rows of the weight, whose
bits are the full product's (a row's logit does not depend on the other rows or outputs of the call).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ops import linear, quantized


# Fewer rows than this take the full logits: up to 4 rows the full product is coded_linear's few-row path,
# bound by reading the layer's 28 MiB, which the first pass reads as well (bench/greedy_head.py: no gain
# at 1-4 rows, about half the time from 6 on). float32 only: coded_linear's bfloat16 rows cost more
MIN_ROWS = 5
# bfloat16 on a CPU with AMX tiles: more rows than this take the full logits, oneDNN's AMX product being
# then as fast as the first pass
BF16_AMX_MAX_ROWS = 24


FIRST_PASS_MARGIN = 0.51   # the kernel's own multiple of the bound (kernels/cpu/greedy_head.cpp, kMargin)
# logits rounded to bfloat16 keep 8 significant bits: one whose float32 value lies within 2^-7 of the largest
# lower end, relatively, can round to the largest logit's value
BF16_SLACK = 2.0 ** -7


def bf16_margin(k: int) -> float:
    """The bound's multiple that covers a bfloat16 layer's logit: the first pass's own, plus the weights
    rounded to bfloat16 (2^-9 of each) and the float32 sum of k products (k 2^-24), both relative to
    sum |x| |w|, which is at most 127 times the bound (each block's |x| is at most 127 times its scale)."""
    return FIRST_PASS_MARGIN + 127 * (1 + 2.0 ** -9) * (2.0 ** -9 + k * 2.0 ** -24)


class GreedyHead:
    """The output layer's codes laid out for the kernel's first pass, beside the codes it recomputes from
    (float32), or beside the bfloat16 weight whose rows give the candidates' logits (`weight`)."""

    def __init__(self, kernel, codes: quantized.Codes, weight: torch.Tensor | None = None):
        self.kernel, self.codes, self.weight = kernel, codes, weight
        groups, k, lanes = codes.codes.shape
        # [N / 16, K / 4, 16, 4]: per group and four inputs, each row's four codes in one 32-bit lane,
        # plus 128 (the first pass multiplies unsigned bytes by the signed ones of x)
        self.packed = (codes.codes.view(groups, k // 4, 4, lanes).permute(0, 1, 3, 2).to(torch.int16) + 128) \
            .to(torch.uint8).contiguous()
        # per row and block of 32 inputs, |scale| * sum |code|: the bound's weight of that block's error
        blocks = codes.codes.view(groups, k // quantized.BLOCK, quantized.BLOCK, lanes)
        self.absums = (blocks.to(torch.int32).abs().sum(2).float() * codes.scales.float().abs()).contiguous()

    def takes(self, rows: int) -> bool:
        """Whether a step's `rows` greedy rows are faster through the head than through the full logits."""
        if self.weight is None:
            return rows >= MIN_ROWS
        return rows <= BF16_AMX_MAX_ROWS or not linear.has_amx()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.absums.numel() * 4

    def tokens(self, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per row of hidden [rows, K] (the layer's dtype): its greedy token (-1 where a value is not
        finite: that row needs the full logits), and how many logits were computed exactly."""
        if self.weight is None:
            tokens, _, counts = self.kernel.q8_argmax(hidden.contiguous(), self.packed, self.codes.codes,
                                                      self.codes.scales, self.absums)
            return tokens.tolist(), counts.tolist()
        return self._bf16_tokens(hidden.contiguous())

    def _bf16_tokens(self, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        k = hidden.shape[1]
        candidates, offsets, finite = self.kernel.q8_candidates(hidden.float(), self.packed, self.codes.scales,
                                                                self.absums, bf16_margin(k), BF16_SLACK)
        counts = offsets.diff()
        rows = hidden.shape[0]
        if candidates.numel() == 0:
            return [-1] * rows, [0] * rows
        # every row's candidates in one product: the union's logits, then each row's own picked out
        union, column = torch.unique(candidates, return_inverse=True)   # sorted: the first index wins a tie
        logits = F.linear(hidden, self.weight.index_select(0, union)).float()
        mine = torch.zeros(rows, union.numel(), dtype=torch.bool)
        mine[torch.repeat_interleave(torch.arange(rows), counts), column] = True
        scores = logits.masked_fill(~mine, float("-inf"))
        tokens = union[scores.argmax(1)]
        # a logit that is not finite (or a row with none) is left to the full logits and the sampler
        usable = finite & (counts > 0) & torch.isfinite(logits.masked_fill(~mine, 0.0)).all(1)
        return torch.where(usable, tokens, -1).tolist(), torch.where(finite, counts, 0).tolist()


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_GREEDY_HEAD", "1") != "0"


def build(head: torch.nn.Module, kernel) -> GreedyHead | None:
    """A GreedyHead for the output layer `head` when its CPU weight is Q8_0 codes (float32), or those codes
    rounded to bfloat16 (the codes its route kept), and the kernel has the first pass, else None."""
    weight = getattr(head, "weight", None)
    if not enabled() or kernel is None or not kernel.has_q8_argmax() or getattr(head, "bias", None) is not None \
            or weight is None or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
        return None
    routed = head.__dict__.get("forward")   # ops/linear.py's route keeps the codes it found
    codes = getattr(routed, "codes", None)
    if codes is None and weight.dtype == torch.float32:
        codes = quantized.find_codes(weight)
    if codes is None or codes.kind != "q8_0" or (weight.dtype == torch.bfloat16 and not codes.rounds_to(kernel, weight)):
        return None
    return GreedyHead(kernel, codes, weight if weight.dtype == torch.bfloat16 else None)
