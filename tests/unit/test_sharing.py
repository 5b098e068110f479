"""Fork, copy-on-write and the prefix cache in the block manager, with exact block ids."""
from control_plane.block_manager import BlockManager
from tests.helpers import free_order


def make_bm(num_blocks=8, block_size=4, caching=True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=caching)


def test_fork_shares_every_block_and_copies_the_partial_one_on_write():
    bm = make_bm()
    bm.grow(1, 6)                                   # blocks 0, 1 (second holds 2 of 4 tokens)
    bm.fork(1, 2)
    assert bm.block_ids(2) == [0, 1]
    assert [b.ref_count for b in bm.tables[1]] == [2, 2]
    growth = bm.grow(2, 7, write_from=6)            # the child writes token 6 into shared block 1
    assert growth.copies == [(1, 1, 2)] and growth.new_block_ids == []
    assert bm.block_ids(2) == [0, 2] and bm.block_ids(1) == [0, 1]
    growth = bm.grow(1, 7, write_from=6)            # the parent now owns block 1 alone: no copy
    assert growth.copies == []
    bm.check_integrity()
    bm.free(1)
    assert bm.pool.blocks[0].ref_count == 1          # still the child's
    bm.free(2)
    assert bm.num_free_blocks() == 8
    bm.check_integrity()


def test_copy_on_write_needs_a_free_block():
    bm = make_bm(num_blocks=2)
    bm.grow(1, 6)
    bm.fork(1, 2)
    assert bm.grow(2, 7, write_from=6) is None
    assert bm.block_ids(2) == [0, 1]                # nothing changed
    bm.check_integrity()


def test_writing_a_fresh_block_after_a_fork_copies_nothing():
    bm = make_bm()
    bm.grow(1, 8)                                   # two full blocks
    bm.fork(1, 2)
    growth = bm.grow(2, 9, write_from=8)
    assert growth.copies == [] and growth.new_block_ids == [2]


def test_prefix_cache_reuses_full_blocks_but_never_the_last_token():
    bm = make_bm()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]    # 2 full blocks + 2 tokens
    bm.grow(1, len(prompt))
    bm.cache_computed_blocks(1, prompt, len(prompt))
    assert bm.match_prefix(2, prompt) == 8           # both full blocks
    assert bm.block_ids(2) == [0, 1]
    exact = prompt[:8]                               # ends on a block boundary
    assert bm.match_prefix(3, exact) == 4            # its last token's block is recomputed
    assert bm.match_prefix(4, [5, 6, 7, 99, 9]) == 0
    assert bm.prefix_queries == 10 + 8 + 5 and bm.prefix_hits == 8 + 4
    bm.check_integrity()


def test_cached_free_blocks_are_evicted_lazily_in_lru_order():
    bm = make_bm(num_blocks=4)
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    bm.grow(1, 5)                                    # blocks 0, 1
    bm.cache_computed_blocks(1, a, 5)
    bm.free(1)                                       # free list: 2 3 1 0 ; block 0 still cached
    assert free_order(bm.pool) == [2, 3, 1, 0]
    bm.grow(2, 5)                                    # takes 2, 3
    bm.cache_computed_blocks(2, b, 5)
    bm.free(2)                                       # free list: 1 0 3 2
    assert bm.match_prefix(3, a) == 4                # block 0 comes back off the free list
    assert bm.block_ids(3) == [0]
    bm.free(3)                                       # free list: 1 3 2 0
    bm.grow(4, 12)                                   # takes 1, 3, 2: evicts b's cached block 2
    assert bm.match_prefix(5, b) == 0
    assert bm.match_prefix(6, a) == 4                # a's block 0 was freed last, still cached
    bm.check_integrity()


def test_hash_collision_is_a_miss():
    bm = make_bm()
    bm.grow(1, 5)
    bm.cache_computed_blocks(1, [1, 2, 3, 4, 0], 5)
    block = bm.tables[1][0]
    other_key = (None, (9, 9, 9, 9))
    # pretend another block's contents hash to the same value: lookup compares the key
    assert bm.pool.lookup(block.block_hash, other_key) is None
    assert bm.pool.lookup(block.block_hash, block.key) is block


def test_prefix_caching_off_shares_nothing():
    bm = make_bm(caching=False)
    prompt = list(range(10))
    bm.grow(1, 10)
    bm.cache_computed_blocks(1, prompt, 10)
    assert bm.match_prefix(2, prompt) == 0
    assert not bm.pool.cached


def test_same_contents_cached_twice_keep_one_entry():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5]
    bm.grow(1, 5)
    bm.grow(2, 5)                                    # computed concurrently: no hit for either
    bm.cache_computed_blocks(1, prompt, 5)
    bm.cache_computed_blocks(2, prompt, 5)
    assert bm.tables[1][0].block_hash is not None and bm.tables[2][0].block_hash is None
    bm.check_integrity()
