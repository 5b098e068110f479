"""Physical KV blocks and the pool that hands them out. Knows nothing of requests.

Free blocks wait in one ordered dict used as an LRU list: allocation takes the oldest,
freeing appends at the newest end, and any block can leave the list in O(1) (needed when
a cached free block is reused by a prefix-cache hit).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and hashed (prefix caching)


class BlockPool:
    def __init__(self, num_blocks: int):
        assert num_blocks > 0, "a pool needs blocks"
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> Block | None:
        """The least recently freed block with ref count 1, or None when the pool is empty."""
        if not self._free:
            return None
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref count {block.ref_count}"
        block.block_hash = None
        block.ref_count = 1
        return block

    def allocate_many(self, count: int) -> list[Block] | None:
        """`count` blocks, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        return [self.allocate() for _ in range(count)]

    def incref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def free(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None

    def free_block_ids(self) -> list[int]:
        """In allocation order (oldest first): for tests and integrity checks."""
        return list(self._free)

    def check_integrity(self, references: dict[int, int]) -> None:
        """`references`: block id -> how many block-table entries point at it."""
        for block in self.blocks:
            is_free = block.block_id in self._free
            refs = references.get(block.block_id, 0)
            assert is_free == (block.ref_count == 0), \
                f"block {block.block_id}: free={is_free} but ref count {block.ref_count}"
            assert block.ref_count == refs, \
                f"block {block.block_id}: ref count {block.ref_count}, referenced {refs} times"
