"""data_plane/block_tables.py: the runner's block tables kept between steps, patched by plans."""
import torch

from data_plane.block_tables import BlockTables
from shared.protocol import FREED_BLOCK_ID


def test_rows_are_patched_gathered_in_order_and_reused():
    tables = BlockTables(width=2, capacity=2)
    a = tables.add([4, 5])
    b = tables.add([FREED_BLOCK_ID, 7])     # a block that left the window stands as 0
    c = tables.add([9])                     # a third row: the tensor grows
    tables.extend(a, 2, [6, 8, 10])         # past the width: the tensor widens
    tables.remap(b, 1, 3)                   # copy-on-write
    got = tables.gather([c, a, b], 5)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [[9, 0, 0, 0, 0], [4, 5, 6, 8, 10], [0, 3, 0, 0, 0]]
    assert tables.gather([b], 2).tolist() == [[0, 3]]
    tables.release(a)
    again = tables.add([2])                 # a released row comes back cleared
    assert again == a and tables.gather([again], 5).tolist() == [[2, 0, 0, 0, 0]]
