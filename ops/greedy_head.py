"""The greedy token of rows that want nothing else, without their 49,152 logits.

A greedy row whose request asked for no log-probs needs only the first index of its largest logit. When
the output layer is float32 GGUF Q8_0 codes (the default model's tied embedding), the kernel
pagedserve_kernels/cpu/greedy_head.cpp finds it from an integer first pass with a proven error bound and the exact
logits of the few outputs that bound leaves in the running: the token, and its logit, have the bits the
full product gives. Needs AVX512-VNNI or AVX2 (`has_q8_argmax`, `q8_argmax_kind`); elsewhere, and with
PAGEDSERVE_GREEDY_HEAD=0, every row takes the full logits.

A plain output layer (a model's own float weights, no codes) gets Q8_0 codes found near it at start
(`NearCodes`): the first pass reads those, and its bound grows by what the codes miss, per block the norm of
w - scale * code times the norm of x's block. The candidates' logits are the weight's own, as its route computes
them: float32 panels (`panel_linear`: the FMA chain over k), or bfloat16 in the AVX512-BF16 kernel
(`has_bf16_argmax`) or in torch's own order where that is the route (AVX2: `bf16_dots_linear`,
`has_bf16_dots_argmax`), rounded to bfloat16, the token the first index of the largest of those, as the sampler
takes it from the full bfloat16 logits. A bfloat16 layer rounded from Q8_0 codes is one too, its codes those it
was rounded from (what they miss: the rounding). The codes and their bounds take about 1.5 bytes a weight beside the layer.
"""
from __future__ import annotations

import os

import torch

from ops import quantized


# Fewer rows than this, by the kernel's first pass, take the full logits where the layer is codes (or rounded from
# them): there the full product is the codes' few-row path, which reads the layer as the first pass does. On
# SmolLM2's states (bench/greedy_head.py, each repeat other states) the head took 0.55-0.79x the float32
# product's time at 1-64 rows with AVX2 and 0.39-0.52x the bfloat16 one's in torch's order, and a step of one
# request took 0.95x and 0.91x its time (bench/step_mix.py). With AVX512-VNNI 0.51-0.88x the float32 time at 1-8
# rows, but a one-request step's time showed no difference from one row: from two, as before.
# "avx512_bf16": a bfloat16 layer on the AVX512-BF16 kernel, 0.81-1.05x at 2-5 rows when last measured (on one
# state only, the one that leaves the most candidates), not since.
MIN_ROWS = {"avx512_vnni": 2, "avx2": 1, "avx512_bf16": 2}
# A plain layer's full product reads 2 or 4 bytes a weight where the first pass reads about one and a half: on
# the 415M model's output layer (bench/greedy_head.py --model) the head took 0.32-0.48x the float32 product's
# time and 0.58-0.75x the bfloat16 one's at 1-64 rows, 0.50-0.68x the float32 one's on AVX2
PLAIN_MIN_ROWS = {"avx512_vnni": 1, "avx2": 1}


NORM_GROUPS = 256   # groups of 16 rows a time: their float64 weights a few MB, where a whole layer's are hundreds
LEVELS = 127        # Q8_0's codes span -127..127 (scale = max |w| / 127)


def _up(values: torch.Tensor) -> torch.Tensor:
    """float64 values rounded up to float32: a bound they weigh is never less than the real one."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)


def _half_up(values: torch.Tensor) -> torch.Tensor:
    """Non-negative float64 values rounded up to float16."""
    rounded = values.to(torch.float16)
    # the next float16 up of a non-negative one is the next integer of its bits
    return torch.where(rounded.double() < values, (rounded.view(torch.int16) + 1).view(torch.float16), rounded)


def _norms_up(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Euclidean norms of blocks of weights scale * code, codes [G, B, 32, 16] and scales [G, B, 16]:
    in float64 (each weight exact there, as in float32), then rounded up to float32."""
    return _up((codes.double() * scales.double()[:, :, None, :]).pow(2).sum(2).sqrt())


class NearCodes:
    """Q8_0 codes found near a plain weight [N, K] and what the greedy head's bound needs of them, in the
    layouts of quantized.Codes: codes int8 [N / 16, K, 16], scales float16 [N / 16, K / 32, 16]; per output and
    block, absums (sum |w|, or |scale| * sum |codes| where larger), norms (of scale * code) and resids (of
    w - scale * code), float32 [N / 16, K / 32, 16], rounded up. `codes`: Q8_0 codes to take instead of finding
    them (a bfloat16 weight's, rounded from them: its resids then only that rounding's)."""

    def __init__(self, weight: torch.Tensor, codes: quantized.Codes | None = None):
        n, k = weight.shape
        groups, blocks = n // quantized.GROUP, k // quantized.BLOCK
        self.codes = torch.empty(groups, k, quantized.GROUP, dtype=torch.int8)
        self.scales = torch.empty(groups, blocks, quantized.GROUP, dtype=torch.float16)
        self.absums, self.norms, self.resids = (torch.empty(groups, blocks, quantized.GROUP) for _ in range(3))
        for g in range(0, groups, NORM_GROUPS):
            rows = slice(g * quantized.GROUP, (g + NORM_GROUPS) * quantized.GROUP)
            # [G, 16, B, 32] -> [G, B, 32, 16]: each block's 32 inputs, then the group's 16 outputs
            w = weight[rows].double().view(-1, quantized.GROUP, blocks, quantized.BLOCK).permute(0, 2, 3, 1)
            part = slice(g, g + NORM_GROUPS)
            if codes is not None:
                scale = codes.scales[part]
                code = codes.codes[part].view(-1, blocks, quantized.BLOCK, quantized.GROUP).double()
            else:
                scale = _half_up(w.abs().amax(2) / LEVELS)   # so that no code is clamped: |w - scale * code| <= scale / 2
            if not torch.isfinite(scale).all():
                raise ValueError("weights beyond float16's range times 127: no Q8_0 codes near them")
            step = scale.double()[:, :, None, :]
            if codes is None:
                code = torch.where(step > 0, w / torch.where(step > 0, step, 1.0), 0.0).round().clamp(-LEVELS, LEVELS)
            self.codes[part] = code.to(torch.int8).reshape(-1, k, quantized.GROUP)
            self.scales[part] = scale
            near = code * step
            self.absums[part] = _up(torch.maximum(w.abs().sum(2), near.abs().sum(2)))
            self.norms[part] = _norms_up(code, scale)
            self.resids[part] = _up((w - near).pow(2).sum(2).sqrt())


class GreedyHead:
    """The output layer's codes laid out for the kernel's first pass, beside the codes (or the weight) whose
    logits it recomputes. `codes`: the layer's own Q8_0 codes, or NearCodes of a plain weight (then `weight`,
    float32 or bfloat16, is that layer's weight). `codes_rows`: whether the layer's few rows read codes (its
    own, or those it was rounded from)."""

    def __init__(self, kernel, codes: quantized.Codes | NearCodes, weight: torch.Tensor | None = None,
                 codes_rows: bool = True, dots: bool = False):
        near = isinstance(codes, NearCodes)
        self.kernel = kernel
        self.codes = None if near else codes   # the kernel recomputes from these (else from `weight`)
        self.scales = codes.scales
        # bfloat16 [N, K] (the codes' rounding, or a plain weight) or float32 [N, K] (a plain weight): the
        # logits that decide are its (or None: the codes')
        self.weight = weight
        self.dots = dots   # a bfloat16 weight's logits in torch's own order (bf16_dots_linear's), not bf16_linear's
        self.kind = kernel.q8_argmax_kind()
        # a step's greedy rows it serves, at least: where the layer is codes, or rounded from them, its few rows
        # read those
        dot = weight is not None and weight.dtype == torch.bfloat16 and not dots
        self.min_rows = MIN_ROWS["avx512_bf16" if dot else self.kind] if codes_rows else PLAIN_MIN_ROWS[self.kind]
        groups, k, lanes = codes.codes.shape
        # [N / 16, K / 4, 16, 4]: per group and four inputs, each row's four codes in one 32-bit lane,
        # plus 128 (the first pass multiplies unsigned bytes by the signed ones of x)
        self.packed = (codes.codes.view(groups, k // 4, 4, lanes).permute(0, 1, 3, 2).to(torch.int16) + 128) \
            .to(torch.uint8).contiguous()
        self.resids = codes.resids if near else None   # the bound's weight of x itself (plain weights)
        if near:
            self.absums, self.norms = codes.absums, codes.norms
        else:
            # per row and block of 32 inputs, |scale| * sum |code|: the weight of the bound's share for float rounding
            blocks = codes.codes.view(groups, k // quantized.BLOCK, quantized.BLOCK, lanes)
            self.absums = (blocks.to(torch.int32).abs().sum(2).float() * codes.scales.float().abs()).contiguous()
            # per row and block, the Euclidean norm of its weights: the bound's weight of x's rounding
            self.norms = torch.empty_like(self.absums)
            for g in range(0, groups, NORM_GROUPS):
                self.norms[g:g + NORM_GROUPS] = _norms_up(blocks[g:g + NORM_GROUPS], codes.scales[g:g + NORM_GROUPS])
        # per group of 16 outputs and block, the largest norm, absum (and resid) of its outputs: the group's
        # widest bound
        self.widest = torch.stack([t.amax(2) for t in (self.norms, self.absums, self.resids) if t is not None],
                                  1).contiguous()

    @property
    def nbytes(self) -> int:
        """The bytes laid out for the first pass (the codes or weight it recomputes from are the layer's)."""
        extra = [t for t in (self.absums, self.norms, self.widest, self.resids) if t is not None]
        return self.packed.numel() + self.scales.numel() * 2 * (self.codes is None) + sum(t.numel() * 4 for t in extra)

    def argmax(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """The kernel's tensors for hidden [rows, K] (the output layer's type): per row the greedy token (-1 where
        a value is not finite, or for bfloat16 too small: that row needs the full logits), its logit, and how many
        logits were computed exactly."""
        return self.kernel.q8_argmax(hidden.float().contiguous(), self.packed,
                                     None if self.codes is None else self.codes.codes, self.scales, self.absums,
                                     self.norms, self.widest, self.weight, self.resids, self.dots)

    def tokens(self, hidden: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per row of hidden: its greedy token (or -1, as `argmax`) and how many logits were computed exactly."""
        tokens, _, counts = self.argmax(hidden)
        return tokens.tolist(), counts.tolist()


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_GREEDY_HEAD", "1") != "0"


def build(head: torch.nn.Module, kernel) -> GreedyHead | None:
    """A GreedyHead for the output layer `head` where the kernel has the first pass and its CPU weight is
    Q8_0 codes (float32), or their rounding to bfloat16, or a plain weight (codes found near it): float32 laid
    out in panels, bfloat16 with the AVX512-BF16 kernel or torch's order (bf16_dots_linear) as its route.
    Else None."""
    weight = getattr(head, "weight", None)
    if not enabled() or kernel is None or not kernel.has_q8_argmax() or getattr(head, "bias", None) is not None \
            or weight is None or weight.device.type != "cpu":
        return None
    routed = head.__dict__.get("forward")   # ops/linear.py's route keeps the codes it found
    if weight.dtype == torch.bfloat16:
        # the exact logits are the AVX512-BF16 kernel's (bf16_linear: `dot` is its layout) or those in torch's
        # order (`dots`), whose bits every row count of the route gives; the codes those of the float32 weight it
        # was rounded from, else found near it
        dots = bool(getattr(routed, "dots", False))
        if not (kernel.has_bf16_dots_argmax() if dots else
                kernel.has_bf16_argmax() and getattr(routed, "dot", None) is not None):
            return None
        codes = routed.plain_codes
        weight = weight.detach().contiguous()
        # (either kind of bfloat16 weight is as a plain one: the codes it was rounded from are nearest, its rounding
        # what they miss)
        return GreedyHead(kernel, NearCodes(weight, codes if codes is not None and codes.kind == "q8_0" else None),
                          weight, codes_rows=codes is not None, dots=dots)
    if weight.dtype != torch.float32:
        return None
    codes = getattr(routed, "codes", None)
    if codes is None and getattr(routed, "panel", None) is not None:
        # panel_linear's logits: the FMA chain over k of the weight as it is
        weight = weight.detach().contiguous()
        return GreedyHead(kernel, NearCodes(weight), weight, codes_rows=False)
    if codes is None:
        codes = quantized.find_codes(weight)
    return GreedyHead(kernel, codes) if codes is not None and codes.kind == "q8_0" else None
