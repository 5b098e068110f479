"""Physical KV blocks and the pool that hands them out. Knows nothing of requests.

Free blocks wait in one ordered dict used as an LRU list: allocation takes the oldest,
freeing appends at the newest end, and any block can leave the list in O(1) (a cached free
block reused by a prefix-cache hit). A free block that still carries a hash stays findable
in `cached` until it is allocated for something else (lazy eviction).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None          # set once the block is full and computed (prefix caching)
    # (parent block's hash, the block's tokens): compared on lookup so that a hash collision is a miss
    key: tuple | None = None
    freed_by_window: bool = False          # free because it left the sliding window (GET /debug/kv/blocks)


class BlockPool:
    def __init__(self, num_blocks: int):
        assert num_blocks > 0, "a pool needs blocks"
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, Block] = {}    # block hash -> block holding those tokens
        self.num_shared = 0                   # blocks with ref count > 1, kept as refs change

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_block_ids(self):
        """The free blocks' ids, least recently freed first (a live view: do not change the pool while
        iterating it)."""
        return self._free.keys()

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> Block | None:
        """The least recently freed block with ref count 1, or None when the pool is empty."""
        if not self._free:
            return None
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref count {block.ref_count}"
        if block.block_hash is not None:   # evict its cached contents
            del self.cached[block.block_hash]
            block.block_hash = block.key = None
        block.ref_count = 1
        block.freed_by_window = False
        return block

    def allocate_many(self, count: int) -> list[Block] | None:
        """`count` blocks, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        return [self.allocate() for _ in range(count)]

    def incref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
            block.freed_by_window = False
        block.ref_count += 1
        if block.ref_count == 2:
            self.num_shared += 1

    def free(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 1:
            self.num_shared -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None

    # --- prefix cache ---------------------------------------------------------------
    def lookup(self, block_hash: int, key: tuple) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.key != key:   # a collision is a miss
            return None
        return block

    def register(self, block: Block, block_hash: int, key: tuple) -> bool:
        """Makes a full, computed block findable; False if those contents are already cached elsewhere."""
        assert block.ref_count > 0 and block.block_hash is None, f"block {block.block_id} cannot be registered"
        if block_hash in self.cached:
            return False
        block.block_hash, block.key = block_hash, key
        self.cached[block_hash] = block
        return True

    def check_integrity(self, references: dict[int, int]) -> None:
        """`references`: block id -> how many block-table entries point at it."""
        for block in self.blocks:
            is_free = block.block_id in self._free
            refs = references.get(block.block_id, 0)
            assert is_free == (block.ref_count == 0), \
                f"block {block.block_id}: free={is_free} but ref count {block.ref_count}"
            assert block.ref_count == refs, \
                f"block {block.block_id}: ref count {block.ref_count}, referenced {refs} times"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id}: hash not indexed"
        assert all(b.block_hash == h for h, b in self.cached.items()), "cache index out of date"
        assert self.num_shared == sum(b.ref_count > 1 for b in self.blocks), "shared-block count out of date"
