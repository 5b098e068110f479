"""Block-level cache ops (copy-on-write copies): checks, then dispatch."""
from __future__ import annotations

import torch

from ops import reference
from ops.attention import use_triton


def copy_blocks(caches: list[torch.Tensor], src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    """For every cache tensor [blocks, ...], copy block src_block_ids[i] over dst_block_ids[i]."""
    assert src_block_ids.shape == dst_block_ids.shape and src_block_ids.dim() == 1, "one dst per src"
    if src_block_ids.numel() == 0 or not caches:
        return
    if use_triton(caches[0].device):
        from kernels.cache_ops import copy_blocks_triton
        copy_blocks_triton(caches, src_block_ids, dst_block_ids)
    else:
        reference.copy_blocks(caches, src_block_ids, dst_block_ids)
