"""Every live sequence's block table as one row of an int32 tensor kept between steps.

A plan changes a table only at its end (new blocks) or at a few entries (copy-on-write remaps), so the
rows are patched where the plan says, and a step's tables are one gather of its sequences' rows
instead of a tensor built from Python lists for each sequence at each step. Entries past a table's
end are 0; so are blocks freed from a sliding window (the plan's -1): the attention never reads a
position outside the window (ModelRunner._check_freed), so any valid block id may stand there.
"""
from __future__ import annotations

import torch

from shared.protocol import FREED_BLOCK_ID


class BlockTables:
    def __init__(self, width: int, capacity: int = 64):
        self.rows = torch.zeros(capacity, max(1, width), dtype=torch.int32)
        self.free = list(range(capacity - 1, -1, -1))   # popped from the end: row 0 first

    def add(self, block_ids: list[int]) -> int:
        """A row for a new sequence's table; returns its index."""
        if not self.free:
            grown = torch.zeros(2 * self.rows.shape[0], self.rows.shape[1], dtype=torch.int32)
            grown[:self.rows.shape[0]] = self.rows
            self.free = list(range(grown.shape[0] - 1, self.rows.shape[0] - 1, -1))
            self.rows = grown
        row = self.free.pop()
        self.rows[row].zero_()
        self.extend(row, 0, block_ids)
        return row

    def release(self, row: int) -> None:
        self.free.append(row)

    def extend(self, row: int, start: int, block_ids: list[int]) -> None:
        """Entries start .. start + len(block_ids) - 1 of the row."""
        if not block_ids:
            return
        end = start + len(block_ids)
        if end > self.rows.shape[1]:
            grown = torch.zeros(self.rows.shape[0], max(end, 2 * self.rows.shape[1]), dtype=torch.int32)
            grown[:, :self.rows.shape[1]] = self.rows
            self.rows = grown
        self.rows[row, start:end] = torch.tensor([0 if b == FREED_BLOCK_ID else b for b in block_ids],
                                                 dtype=torch.int32)

    def remap(self, row: int, index: int, block: int) -> None:
        self.rows[row, index] = block

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The tables of `rows`, in that order, as a contiguous int32 [len(rows), width]."""
        return self.rows[:, :width].index_select(0, torch.tensor(rows, dtype=torch.int64))
