"""Pieces shared by the paged attention kernels: the paged address of a KV tile, dot settings."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x * scale) == exp2(x * scale * log2(e))


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_config(dtype: torch.dtype, device: torch.device) -> tuple[str, bool]:
    """(input_precision, upcast) for tl.dot on operands of `dtype`.

    float32 uses "ieee": the default tf32 keeps 10 mantissa bits, which would make float32 no more
    accurate than float16.  upcast=True turns bfloat16 operands into float32 before tl.dot; only
    the CPU interpreter needs it (its tl.dot multiplies the raw uint16 bit patterns of bfloat16).
    """
    interpreted = device.type != "cuda" or triton.knobs.runtime.interpret
    upcast = interpreted and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return precision, upcast


@triton.jit
def kv_row_offsets(table_row, pos, valid, stride_cb, stride_ct, BLOCK_SIZE: tl.constexpr):
    """Element offset of the cache row of each logical token position `pos` of one sequence.

        pos:        0 1 2 3 | 4 5 6 7 | 8 9 ...        (BLOCK_SIZE = 4)
        table_row:  [ 7     ,  2      ,  5  ...]       physical block of each logical block
        offset:     7*sb+0*st, 7*sb+1*st, ..., 2*sb+0*st, ...

    Positions outside `valid` read no table entry (the table row may be shorter than the tile).
    """
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_ct


@triton.jit
def soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap) (Gemma 2's attention logit cap), tanh from exp: the interpreter
    and every backend have exp; 1 - 2 / (e^2x + 1) saturates to +-1 without overflow trouble."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


def score_args(scale: float, sliding_window: int | None, softcap: float | None) -> tuple[float, float, int]:
    """The kernels' (qk_scale, softcap, window) arguments: softmax runs in base 2, so without a cap
    the log2(e) factor folds into the scale; with one, the cap applies to the natural score and
    log2(e) after it. 0 means no cap, no window."""
    return (scale if softcap else scale * LOG2E), float(softcap or 0.0), int(sliding_window or 0)


def variant_args(query: torch.Tensor, sinks, alibi, chunk) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernels' (sinks, alibi, chunk) arguments: per-head float32 tensors, or the query as an unused
    placeholder (the HAS_SINKS / HAS_ALIBI constants say which), and the chunk length (0: none)."""
    return (query if sinks is None else sinks), (query if alibi is None else alibi), int(chunk or 0)


@triton.jit
def per_head_base2(values, heads, mask):
    """A per-query-head float32 value (a sink's logit, an ALiBi slope) for `heads`, times log2(e): the
    kernels' softmax runs in base 2."""
    return tl.load(values + heads, mask=mask, other=0.0).to(tl.float32) * LOG2E
