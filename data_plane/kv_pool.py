"""The device KV pool: one tensor holding every block of every attention layer.

    pool[slab, 0 = K | 1 = V, block, offset in block, kv head, head dim]

A block holds the K/V of a few tokens for the layers of one layer group, one slab per layer of the group.
A layer that keeps a per-sequence state instead (LFM2's convolutions, Mamba mixers) has no slab, its state
lives in the state pool (data_plane/state_pool.py). Its size in blocks is fixed at start and reported at the
handshake; the control plane's block manager decides which block ids are used for what.

Layer groups (`layout`): where the attention layers differ in how far back they read (GPT-OSS and Gemma
alternate sliding-window and full layers, Llama 4 chunked and global ones), the layers of each reach form
groups of equal size S, and each group has a block table of its own per sequence. Block ids come from one
pool, and a block belongs to one group at a time, so its S slabs hold that group's layers: the blocks of a
sliding group that left the window go back to the pool while the full groups keep theirs (vLLM V1's hybrid
allocator lays its pages out the same way). Tables travel interleaved, entry i * G + g being group g's
block i (G groups). Where every layer reads as far, there is one group and S is every attention layer.

    GPT-OSS, layers sliding, full, sliding, full:   S = 2, G = 2
    layer:  0  1  2  3      group:  1  0  1  0      slab:  0  0  1  1      group reaches: [0, W]
"""
from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass

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


# more groups than this cost more in tables and plans than the blocks they free: one group then (nothing
# freed before a sequence ends, as when some layer reads everything)
MAX_GROUPS = 8


@dataclass(frozen=True)
class Layout:
    num_slabs: int                     # slabs of a block: layers per group (every attention layer for one group)
    slabs: dict[int, int] | None       # model layer index -> its slab; None: the layer index itself
    groups: dict[int, int] | None      # model layer index -> its group; None: one group
    reaches: list[int]                 # per group, positions a query reads back, its own included; 0: all

    @property
    def num_groups(self) -> int:
        return len(self.reaches)

    @property
    def windowed(self) -> bool:
        """Whether some group reads a bounded window: its blocks that left it are freed (-1 in tables)."""
        return any(self.reaches)


def layout(layer_reaches: dict[int, int | None], num_layers: int) -> Layout:
    """The pool's layout for the attention layers (`layer_reaches`: layer index -> its window or chunk,
    None when it reads the whole context); see the top. Groups of equal size S: S divides the count of
    layers of every reach."""
    attending = sorted(layer_reaches)
    kinds: dict[int, list[int]] = {}   # reach (0: whole context) -> its layers, in order
    for layer in attending:
        kinds.setdefault(layer_reaches[layer] or 0, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values())) if kinds else 0
    if len(kinds) <= 1 or len(attending) // size > MAX_GROUPS:
        reach = 0 if 0 in kinds or not kinds else max(kinds)   # the widest, when every layer has one
        identity = attending == list(range(num_layers))
        return Layout(len(attending), None if identity else {layer: s for s, layer in enumerate(attending)}, None,
                      [reach])
    slabs, groups, reaches = {}, {}, []
    for reach in sorted(kinds):        # the full layers' groups first
        layers = kinds[reach]
        for start in range(0, len(layers), size):
            for slab, layer in enumerate(layers[start:start + size]):
                slabs[layer], groups[layer] = slab, len(reaches)
            reaches.append(reach)
    return Layout(size, slabs, groups, reaches)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14   # <sys/mman.h> on Linux


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's memory (the whole 2 MiB pages inside it) with transparent huge pages,
    before anything touches it; whether Linux accepted the advice (it acts on it where transparent huge
    pages are in `madvise` or `always` mode). A decode step's attention reads blocks scattered over the
    pool: with 4 KiB pages nearly every block is a page of its own to translate."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    length = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    libc = ctypes.CDLL(None)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def allocate_pool(num_slabs: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`num_slabs`: a block's slabs (see `Layout`). On a CPU, in huge pages where Linux allows them."""
    pool = torch.empty(num_slabs, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    advise_huge_pages(pool)
    # zeros, not empty: padding slots of a gathered block are read (then masked) by the CPU path
    return pool.zero_()
