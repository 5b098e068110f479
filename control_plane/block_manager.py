"""Maps sequences to blocks: block tables, growth as sequences grow, freeing.

The scheduler asks it questions ("can this sequence grow to N tokens?") and gets answers:
new block ids, or None when there is no room now.
"""
from __future__ import annotations

from collections import Counter

from control_plane.block_pool import Block, BlockPool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[Block]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def grow(self, seq_id: int, num_tokens: int, reserve: int = 0) -> list[int] | None:
        """Make the sequence's table hold `num_tokens` tokens. Returns the appended block ids
        (possibly none), or None, taking nothing, when fewer than the blocks needed plus
        `reserve` are free."""
        table = self.tables.setdefault(seq_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing <= 0:
            return []
        if missing + reserve > self.pool.num_free:
            if not table:
                del self.tables[seq_id]
            return None
        new_blocks = self.pool.allocate_many(missing)
        table.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, last first, so that a prefix's tail is evicted before its head."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self.pool.free(block)

    def check_integrity(self) -> None:
        references = Counter(b.block_id for table in self.tables.values() for b in table)
        self.pool.check_integrity(references)
