"""The device KV pool: one tensor holding every block of every attention layer.

    pool[slab, 0 = K | 1 = V, block, offset in block, kv head, head dim]

One slab per layer that attends; a layer that keeps a per-sequence state instead (LFM2's convolutions,
Mamba mixers) has none, its state lives in the state pool (data_plane/state_pool.py). `slabs` gives the
map from a model layer index to its slab (the identity when every layer attends). Its size in blocks is
fixed at start and reported at the handshake; the control plane's block manager decides which block ids
are used for what.
"""
from __future__ import annotations

import torch

GIB = 1024 ** 3
DEFAULT_CPU_GIB = 1.0
CUDA_MEMORY_FRACTION = 0.9


def choose_num_blocks(block_bytes: int, device: torch.device, kv_cache_blocks: int | None,
                      kv_cache_gib: float | None, reserve_bytes: int = 0) -> int:
    """`reserve_bytes`: memory something allocated after the pool will need (the decode graphs),
    kept out of the default CUDA budget."""
    if kv_cache_blocks is not None:
        return kv_cache_blocks
    if kv_cache_gib is not None:
        budget = kv_cache_gib * GIB
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = (free - reserve_bytes) * CUDA_MEMORY_FRACTION
    else:
        budget = DEFAULT_CPU_GIB * GIB
    num_blocks = int(budget // block_bytes)
    if num_blocks < 2:
        raise ValueError(f"a KV budget of {budget / GIB:.3f} GiB holds {num_blocks} blocks of "
                         f"{block_bytes} bytes; give more memory")
    return num_blocks


def slabs(attention_layers: list[int], num_layers: int) -> dict[int, int] | None:
    """Model layer index -> its slab of the pool, for the layers in `attention_layers`; None when every one
    of the `num_layers` layers attends, where the slab is the layer index itself (and a step looks nothing up)."""
    if attention_layers == list(range(num_layers)):
        return None
    return {layer: slab for slab, layer in enumerate(attention_layers)}


def allocate_pool(num_slabs: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`num_slabs`: the layers that attend (see `slabs`)."""
    # zeros, not empty: padding slots of a gathered block are read (then masked) by the CPU path
    return torch.zeros(num_slabs, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
