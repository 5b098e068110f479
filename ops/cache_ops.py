"""Block-level cache ops (copy-on-write copies): checks, then dispatch."""
from __future__ import annotations

import torch

from ops import reference
from ops.attention import Backend, choose


def copy_blocks(caches: list[torch.Tensor], src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor,
                backend: Backend | None = None) -> None:
    """For every cache tensor [blocks, ...], copy block src_block_ids[i] over dst_block_ids[i]. `backend`:
    the caller's choice made at start (None: ops.attention.choose now)."""
    assert src_block_ids.shape == dst_block_ids.shape and src_block_ids.dim() == 1, "one dst per src"
    if src_block_ids.numel() == 0 or not caches:
        return
    backend = backend or choose(caches[0].device, caches[0].dtype)
    if backend.triton:
        from pagedserve_kernels.cache_ops import copy_blocks_triton
        copy_blocks_triton(caches, src_block_ids, dst_block_ids)
    else:
        reference.copy_blocks(caches, src_block_ids, dst_block_ids)
