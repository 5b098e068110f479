"""The model's linear layers on CPU: the few-row kernel (kernels/cpu/skinny_linear.cpp) when a step
has only a handful of tokens, torch's GEMM otherwise.

A decode step of a few sequences only streams the weights; torch's GEMM reads them at about a
third of the memory bandwidth for 2-16 rows on this project's 2-core machine, the kernel at
about the full bandwidth. Above SKINNY_MAX_ROWS rows the GEMM's tiling wins and is kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ops import cpu_kernels

# measured on SmolLM2's layer shapes, 2 threads: all linears of a step 1.9-2.3x faster at 2-8 rows,
# 1.4x at 16, even from 24 rows up (bench/cpu_kernels.py)
SKINNY_MAX_ROWS = 16


def use_skinny_kernel(model: torch.nn.Module) -> int:
    """Route the float32, bias-free CPU linear layers of `model` through the kernel when few rows
    come in; returns how many layers were routed (0 when the kernel is unavailable)."""
    eligible = [m for m in model.modules()
                if type(m) is torch.nn.Linear and m.bias is None and m.weight.dtype == torch.float32
                and m.weight.device.type == "cpu" and m.weight.is_contiguous()]
    kernel = cpu_kernels.load() if eligible else None   # no build at all for a GPU or bf16 model
    if kernel is None:
        return 0
    for module in eligible:
        module.forward = _skinny_forward(module, kernel)   # instance attribute: hooks still run
    return len(eligible)


def _skinny_forward(module: torch.nn.Linear, kernel):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= SKINNY_MAX_ROWS and x.dtype == torch.float32 and not torch.is_grad_enabled():
            out = kernel.skinny_linear(x.reshape(rows, x.shape[-1]).contiguous(), module.weight)
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, module.weight)
    return forward
