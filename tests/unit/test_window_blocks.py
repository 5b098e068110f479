"""Blocks that lie wholly outside every layer's sliding window go back to the pool
(control_plane/block_manager.py, top): exact ids, ref counts with forks, swapping, the prefix
cache, and the scheduler freeing them as sequences advance."""
from __future__ import annotations

import random

import pytest

from control_plane.block_manager import BlockManager
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Finish, Scheduler
from control_plane.sequence import Sequence
from shared.protocol import FREED_BLOCK_ID as X, StepResult
from tests.helpers import free_order


def test_dead_blocks_are_exactly_those_no_later_query_reads():
    for window in (1, 3, 4, 6, 9, 16):
        bm = BlockManager(64, 4, sliding_window=window)
        for computed in range(60):
            # a query at `computed` or later sees keys > position - window: none in a dead block
            lowest_read = computed - window + 1
            brute = sum(1 for b in range(15) if (b + 1) * 4 - 1 < lowest_read)
            assert bm.num_dead_blocks(computed) == brute, (window, computed)
    assert BlockManager(64, 4).num_dead_blocks(1000) == 0     # no window: nothing is ever dead


def test_blocks_leave_one_by_one_as_the_window_passes_them():
    bm = BlockManager(8, 4, sliding_window=6)
    bm.grow(1, 16)                                    # blocks 0-3 hold positions 0-15
    assert bm.free_outside_window(1, 8) == 0          # the query at 8 reads 3 .. 8: block 0 too
    assert bm.free_outside_window(1, 9) == 1          # at 9 it reads 4 .. 9: block 0 is dead
    assert bm.block_ids(1) == [X, 1, 2, 3]
    assert free_order(bm.pool) == [4, 5, 6, 7, 0]
    assert bm.free_outside_window(1, 12) == 0         # 7 .. 12: block 1 still holds 7
    assert bm.free_outside_window(1, 13) == 1
    assert bm.free_outside_window(1, 13) == 0         # never freed twice
    assert bm.block_ids(1) == [X, X, 2, 3] and bm.num_window_freed == 2
    bm.check_integrity()
    # the table keeps its logical indices: growing appends after the placeholders
    assert bm.grow(1, 17, write_from=16).new_block_ids == [4]
    assert bm.block_ids(1) == [X, X, 2, 3, 4]
    bm.free(1)
    assert bm.num_free_blocks() == 8
    bm.check_integrity()


def test_without_a_window_nothing_is_freed():
    bm = BlockManager(8, 4)
    bm.grow(1, 30)
    assert bm.free_outside_window(1, 30) == 0
    assert bm.block_ids(1) == list(range(8))


def test_a_fork_holds_shared_blocks_until_it_too_leaves_them():
    bm = BlockManager(10, 4, sliding_window=3)
    bm.grow(1, 10)                                    # blocks 0-2
    bm.fork(1, 2)
    assert bm.free_outside_window(1, 10) == 2         # the query at 10 reads 8 .. 10
    assert bm.block_ids(1) == [X, X, 2] and bm.block_ids(2) == [0, 1, 2]
    assert [bm.pool.blocks[b].ref_count for b in (0, 1, 2)] == [1, 1, 2]
    assert 0 not in free_order(bm.pool)               # the fork still reads them
    bm.check_integrity()
    # a fork of a sequence with placeholders copies them as placeholders, holding no block for them
    bm.fork(1, 3)
    assert bm.block_ids(3) == [X, X, 2] and bm.pool.blocks[2].ref_count == 3
    bm.free_outside_window(2, 10)
    assert free_order(bm.pool)[-2:] == [0, 1]         # both gone from every table: free now
    # copy-on-write of the shared partial block still works beside placeholders
    growth = bm.grow(3, 11, write_from=10)
    assert growth.copies == [(2, 2, 3)] and bm.block_ids(3) == [X, X, 3]
    bm.check_integrity()
    for seq in (1, 2, 3):
        bm.free(seq)
    assert bm.num_free_blocks() == 10
    bm.check_integrity()


def test_swapping_moves_only_blocks_in_the_window():
    bm = BlockManager(8, 4, sliding_window=5, num_cpu_blocks=4)
    bm.grow(1, 14)                                    # blocks 0-3
    bm.free_outside_window(1, 13)                     # reads 9 .. 13: blocks 0, 1 dead
    assert bm.num_blocks_of([1]) == 2 and bm.can_swap_out([1])
    assert bm.swap_out([1]) == [(2, 0), (3, 1)]
    assert bm.cpu_tables[1][:2] == [None, None]
    bm.check_integrity()
    assert bm.swap_in([1]) == [(0, 4), (1, 5)]        # least recently freed device blocks first
    assert bm.block_ids(1) == [X, X, 4, 5]
    bm.check_integrity()


def _computed(bm, seq_id, tokens):
    """Grows the sequence to hold `tokens`, all computed and registered in the prefix cache."""
    bm.grow(seq_id, len(tokens))
    bm.cache_computed_blocks(seq_id, tokens, len(tokens))


def test_a_freed_block_keeps_serving_prefixes_until_it_is_handed_out():
    bm = BlockManager(12, 4, sliding_window=6)
    tokens = list(range(100, 124))                    # 6 full blocks
    _computed(bm, 1, tokens)
    bm.free_outside_window(1, 24)                     # reads 19 .. 23 on: blocks 0-3 freed, still cached
    assert bm.block_ids(1) == [X, X, X, X, 4, 5]
    # a prompt of 21 tokens may reuse 5 blocks (not the last token's): the query at 20 reads 15 .. 20,
    # so blocks 3 and 4 are shared and 0-2 are placeholders
    assert bm.match_prefix(2, tokens[:21]) == 20
    assert bm.block_ids(2) == [X, X, X, 3, 4]
    assert bm.pool.blocks[3].ref_count == 1 and bm.pool.blocks[4].ref_count == 2
    bm.check_integrity()


def test_a_prefix_whose_head_was_evicted_still_serves_from_its_tail():
    bm = BlockManager(10, 4, sliding_window=6)
    tokens = list(range(100, 124))                    # 6 full blocks: 0-5
    _computed(bm, 1, tokens)
    bm.free_outside_window(1, 24)                     # blocks 0-3 freed while 1 runs, head first
    assert free_order(bm.pool) == [6, 7, 8, 9, 0, 1, 2, 3]
    bm.grow(9, 4 * 6)                                 # hands out 6-9, then 0 and 1: evicted
    assert [bm.pool.lookup(*key) is not None for _, *key in _chain(tokens, 6)] == [False] * 2 + [True] * 4
    # a 21-token prompt may reuse 5 blocks: its query at 20 reads 15 .. 20, in blocks 3 and 4, both
    # cached; block 2 is cached too but not read, so not taken; 0 and 1 are gone
    assert bm.match_prefix(2, tokens[:21]) == 20
    assert bm.block_ids(2) == [X, X, X, 3, 4]
    bm.check_integrity()
    bm.reaches = [0]                                  # the same cache, read without a window:
    bm.free(2)
    assert bm.match_prefix(3, tokens[:21]) == 0       # the prefix needs block 0


def test_an_evicted_tail_shortens_the_hit():
    bm = BlockManager(12, 4, sliding_window=6)
    tokens = list(range(100, 132))                    # 8 full blocks: 0-7
    _computed(bm, 1, tokens)
    bm.free(1)                                        # tail first: free order 8-11, 7, 6, ..., 0
    bm.grow(9, 4 * 7)                                 # hands out 8-11, then 7, 6, 5: evicted
    # 7 blocks would need blocks 5, 6 (the query at 28 reads 23 ..); 6 blocks need 4, 5; 5 blocks need
    # 3, 4 (the query at 20 reads 15 .. 20): the longest prefix whose window is cached is 5 blocks
    assert bm.match_prefix(2, tokens[:31]) == 20
    assert bm.block_ids(2) == [X, X, X, 3, 4]
    assert bm.prefix_hits == 20
    bm.check_integrity()


def _chain(tokens, num_blocks):
    from control_plane.block_manager import chain_block_hashes
    return list(chain_block_hashes(tokens, 4, num_blocks))


def test_random_operations_with_forks_and_windows_keep_integrity():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=40, block_size=4, sliding_window=7)
    lengths: dict[int, int] = {}
    next_id = 100
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            seq = rng.randrange(12)
            old = lengths.get(seq, 0)
            target = old + rng.randint(1, 9)
            if bm.grow(seq, target, write_from=old if seq in lengths else None) is not None:
                lengths[seq] = target
        elif op < 0.7 and lengths:
            seq = rng.choice(sorted(lengths))
            bm.free_outside_window(seq, lengths[seq] - rng.randint(0, 3))
        elif op < 0.8 and lengths:
            parent = rng.choice(sorted(lengths))
            bm.fork(parent, next_id)
            lengths[next_id] = lengths[parent]
            next_id += 1
        elif lengths:
            seq = rng.choice(sorted(lengths))
            bm.free(seq)
            del lengths[seq]
        bm.check_integrity()
    assert bm.num_window_freed > 100
    for seq in list(lengths):
        bm.free(seq)
    assert bm.num_free_blocks() == 40
    bm.check_integrity()


def test_integrity_refuses_a_placeholder_inside_the_table():
    bm = BlockManager(8, 4, sliding_window=4)
    bm.grow(1, 12)
    bm.free_outside_window(1, 8)
    bm.tables[1][0], bm.tables[1][1] = bm.tables[1][1], None    # a hole after a live block
    with pytest.raises(AssertionError, match="placeholders not leading"):
        bm.check_integrity()


# --- the scheduler frees them as sequences advance -------------------------------------------------
def _drive(sched, seqs, max_steps=500):
    """Plays the data plane: one sampled token for every sequence that computed all its tokens."""
    for s in seqs:
        sched.add(s)
    peak = 0
    for _ in range(max_steps):
        if not sched.has_work():
            return peak
        plan = sched.schedule()
        ended = []
        for seq in sched.update(plan, StepResult(plan.step_id)):
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    ended.append(Finish(seq, "length"))
        sched.apply(ended)
        sched.check_integrity()
        peak = max(peak, sched.bm.pool.num_blocks - sched.bm.num_free_blocks())
    raise AssertionError("the scheduler makes no progress")


def test_sequences_longer_than_the_pool_run_only_because_blocks_leave_the_window():
    params = SamplingParams(max_tokens=40)

    def two_seqs():   # 12 + 40 = 52 tokens each: 13 blocks, more than the pool of 10
        return [Sequence(f"r{i}", list(range(1, 13)), 12, params, params.spec([]), arrival_time=float(i)) for i in range(2)]

    sched = Scheduler(BlockManager(10, 4, sliding_window=8), max_num_seqs=4, max_num_batched_tokens=8)
    seqs = two_seqs()
    peak = _drive(sched, seqs)
    assert all(s.num_output_tokens == 40 for s in seqs)
    # each holds at most the 3 blocks its next query reads, plus the one it writes into
    assert sched.num_preemptions == 0 and peak <= 2 * 4
    assert sched.bm.num_window_freed >= 2 * (13 - 4)
    assert sched.bm.num_free_blocks() == 10
    # the same work without a window never fits
    sched = Scheduler(BlockManager(10, 4), max_num_seqs=4, max_num_batched_tokens=8)
    with pytest.raises(AssertionError, match="no progress"):
        _drive(sched, two_seqs())
    assert sched.bm.num_window_freed == 0
