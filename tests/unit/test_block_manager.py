import random

import pytest

from control_plane.block_manager import BlockManager
from control_plane.block_pool import BlockPool
from tests.helpers import free_order


def test_pool_allocates_oldest_free_first_and_reuses_in_lru_order():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    pool.free(b)
    pool.free(a)
    assert free_order(pool) == [3, 1, 0]
    assert pool.allocate().block_id == 3
    assert pool.allocate().block_id == 1
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_pool_refuses_partial_allocation():
    pool = BlockPool(3)
    assert pool.allocate_many(4) is None
    assert pool.num_free == 3
    assert [b.block_id for b in pool.allocate_many(3)] == [0, 1, 2]
    assert pool.allocate() is None


def test_incref_takes_a_free_block_off_the_free_list():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.free(block)
    pool.incref(block)
    assert block.ref_count == 1 and free_order(pool) == [1]
    pool.incref(block)
    pool.free(block)
    pool.free(block)
    assert free_order(pool) == [1, 0]
    with pytest.raises(AssertionError):
        pool.free(block)


def grown(bm, seq_id, num_tokens, **kw):
    growth = bm.grow(seq_id, num_tokens, **kw)
    return None if growth is None else growth.new_block_ids


def test_manager_grows_on_block_boundaries_with_exact_ids():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert grown(bm, seq_id=1, num_tokens=5) == [0, 1]
    assert grown(bm, 1, 8) == []          # still fits in two blocks
    assert grown(bm, 2, 3) == [2]
    assert grown(bm, 1, 9) == [3]
    assert bm.block_ids(1) == [0, 1, 3]
    assert bm.grow(2, 30) is None        # would need 7 more blocks
    assert bm.block_ids(2) == [2]        # nothing taken
    bm.check_integrity()


def test_manager_reserve_keeps_a_watermark():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert grown(bm, 1, 12, reserve=1) == [0, 1, 2]
    assert bm.grow(2, 4, reserve=1) is None
    assert 2 not in bm.tables
    assert grown(bm, 2, 4) == [3]


def test_manager_frees_in_reverse_order():
    bm = BlockManager(num_blocks=5, block_size=2)
    bm.grow(1, 6)   # blocks 0, 1, 2
    bm.free(1)
    # the tail of the sequence is freed first so that it is reused (evicted) first
    assert free_order(bm.pool) == [3, 4, 2, 1, 0]
    bm.check_integrity()


def test_integrity_detects_a_table_entry_without_a_reference():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.grow(1, 2)
    bm.tables[2] = [bm.pool.blocks[2]]   # a table pointing at a free block
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4)
    lengths: dict[int, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.5:
            seq = rng.randrange(12)
            target = lengths.get(seq, 0) + rng.randint(1, 9)
            if bm.grow(seq, target) is not None:
                lengths[seq] = target
        elif lengths:
            seq = rng.choice(sorted(lengths))
            bm.free(seq)
            del lengths[seq]
        bm.check_integrity()
        assert sum(len(bm.block_ids(s)) for s in lengths) + bm.num_free_blocks() == 40
    for seq in list(lengths):
        bm.free(seq)
    assert bm.num_free_blocks() == 40
    bm.check_integrity()
