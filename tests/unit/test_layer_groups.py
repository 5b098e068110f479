"""Layer groups (data_plane/kv_pool.py, control_plane/block_manager.py): a model whose layers read back
differently far keeps a block table per group, interleaved in one list; a sliding group's blocks that left
its window go back to the pool while the full group keeps its own, copy-on-write and the prefix cache work
per group, and the data plane refuses a freed block where a group still reads. Token identity of such models
with every layer of the scheduler at work: tests/integration/test_architectures.py."""
from __future__ import annotations

import pytest
import torch

from control_plane.block_manager import BlockManager
from data_plane import attention, kv_pool
from data_plane.model_runner import ModelRunner, PlanError
from shared.config import DataPlaneConfig
from shared.protocol import FREED_BLOCK_ID, NewSequence, SamplingSpec, StepPlan
from tests.architectures import SUPPORTED, build

X = FREED_BLOCK_ID


def test_layout_groups_layers_of_one_reach_into_groups_of_equal_size():
    # sliding, full, sliding, full (GPT-OSS, Gemma 2): two groups of two layers, the full one first
    two = kv_pool.layout({0: 12, 1: None, 2: 12, 3: None}, 4)
    assert (two.num_slabs, two.reaches) == (2, [0, 12])
    assert two.groups == {1: 0, 3: 0, 0: 1, 2: 1} and two.slabs == {1: 0, 3: 1, 0: 0, 2: 1}
    # three chunked layers and a global one (Llama 4): groups of one layer
    four = kv_pool.layout({0: 8, 1: 8, 2: 8, 3: None}, 4)
    assert (four.num_slabs, four.reaches, four.groups) == (1, [0, 8, 8, 8], {3: 0, 0: 1, 1: 2, 2: 3})


def test_layout_is_one_group_where_every_layer_reads_alike_or_groups_would_be_too_many():
    assert kv_pool.layout({0: None, 1: None}, 2) == kv_pool.Layout(2, None, None, [0])
    assert kv_pool.layout({0: 16, 1: 16}, 2) == kv_pool.Layout(2, None, None, [16])
    # a hybrid model's attention layers only (its state layer 0 has no slab)
    assert kv_pool.layout({1: None, 2: None}, 3) == kv_pool.Layout(2, {1: 0, 2: 1}, None, [0])
    # one window layer among many full ones: more groups than MAX_GROUPS, so one group that frees nothing
    many = {i: None for i in range(kv_pool.MAX_GROUPS)} | {kv_pool.MAX_GROUPS: 16}
    assert kv_pool.layout(many, len(many)) == kv_pool.Layout(len(many), None, None, [0])
    assert kv_pool.layout({}, 2) == kv_pool.Layout(0, {}, None, [0])     # Mamba: no layer attends


def _grown(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    assert bm.grow(seq_id, len(tokens), write_from=0) is not None
    bm.cache_computed_blocks(seq_id, tokens, len(tokens))
    bm.free_outside_window(seq_id, len(tokens))


def test_the_sliding_group_frees_its_blocks_and_the_full_group_keeps_its_own():
    bm = BlockManager(32, 4, group_reaches=[0, 8])
    assert bm.blocks_to_grow(1, 20) == 10                 # 5 blocks of tokens, one per group each
    tokens = list(range(100, 120))
    _grown(bm, 1, tokens)
    # the next query, at 20, reads 13 .. 20: the sliding group's blocks 0-2 are dead, the full group's all live
    assert bm.block_ids(1) == [0, X, 2, X, 4, X, 6, 7, 8, 9]
    assert (bm.num_window_freed, bm.num_free_blocks()) == (3, 25)
    bm.check_integrity()
    # a later sequence with the same 21-token prompt shares 20 tokens: all five of the full group's blocks,
    # and of the sliding group's only those its query at 20 reads (3 and 4, still in use by sequence 1)
    assert bm.match_prefix(2, tokens + [7]) == 20
    assert bm.block_ids(2) == [0, X, 2, X, 4, X, 6, 7, 8, 9]
    bm.check_integrity()
    bm.free(1)
    bm.free(2)
    bm.check_integrity()
    assert bm.num_free_blocks() == 32


def test_a_fork_writing_into_a_shared_block_copies_it_in_every_group():
    bm = BlockManager(32, 4, group_reaches=[0, 8])
    _grown(bm, 1, list(range(100, 118)))                  # 18 tokens: block 4 holds two
    bm.fork(1, 2)
    growth = bm.grow(2, 19, write_from=18)
    assert [entry for entry, _, _ in growth.copies] == [8, 9] and not growth.new_block_ids
    assert bm.grow(1, 19, write_from=18).copies == []     # the parent's are its own again
    bm.check_integrity()


@pytest.mark.parametrize("evicted,hit", [
    # the sliding group's dead blocks 0-2 gone: the query at 20 reads only its blocks 3 and 4, both cached
    (3, 20),
    # its block 4 gone as well: no prefix serves, though the full group has all five blocks cached
    (4, 0)])
def test_a_prefix_needs_every_groups_blocks_that_its_query_reads(evicted, hit):
    bm = BlockManager(32, 4, group_reaches=[0, 8])
    tokens = list(range(100, 120))
    _grown(bm, 1, tokens)
    bm.free(1)
    # the pool hands out the 22 blocks never used, then the window's (ids 1, 3, 5: the sliding group's blocks
    # 0-2), then sequence 1's from its end (9: the sliding group's block 4, then 8, ...), evicting each
    taken = [bm.pool.allocate() for _ in range(22 + evicted)]
    assert sorted(b.block_id for b in taken[22:]) == [1, 3, 5, 9][:evicted]
    assert bm.match_prefix(2, tokens + [7]) == hit
    for block in taken:
        bm.pool.free(block)
    bm.check_integrity()


def test_each_group_caches_its_blocks_under_its_own_keys():
    bm = BlockManager(32, 4, group_reaches=[0, 8])
    _grown(bm, 1, list(range(100, 108)))
    full, sliding = bm.tables[1][0], bm.tables[1][1]       # block 0 of each group: the same tokens
    assert full.block_hash != sliding.block_hash and full.key != sliding.key
    assert bm.pool.lookup(full.block_hash, full.key) is full
    assert bm.pool.lookup(sliding.block_hash, sliding.key) is sliding


def test_swapping_keeps_each_groups_placeholders():
    bm = BlockManager(32, 4, num_cpu_blocks=32, group_reaches=[0, 8])
    _grown(bm, 1, list(range(100, 120)))
    pairs = bm.swap_out([1])
    assert len(pairs) == 7                                 # 10 entries less 3 placeholders
    assert [b is None for b in bm.cpu_tables[1]] == [False, True] * 3 + [False] * 4
    assert bm.swap_in([1]) is not None
    assert bm.block_ids(1)[1:6:2] == [X] * 3
    bm.check_integrity()


@pytest.fixture(scope="module")
def gpt_oss_runner():
    model = build(SUPPORTED["GPT-OSS (sinks, alternating window 12, MoE)"], "eager")
    model.set_attn_implementation(attention.register())
    config = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=4, kv_cache_blocks=64, swap_blocks=0)
    return ModelRunner(model, config, torch.device("cpu"))


def test_the_handshake_gives_the_groups_and_a_blocks_slabs(gpt_oss_runner):
    hs = gpt_oss_runner.handshake()
    assert (hs.group_reaches, hs.sliding_window, hs.num_layers) == ([0, 12], 0, 1)
    assert tuple(gpt_oss_runner.pool.shape[:3]) == (1, 2, 64)


def _plan(seq_id: int, table: list[int], num_tokens: int, computed: int) -> StepPlan:
    return StepPlan(1, new_seqs=[NewSequence(seq_id, list(range(10, 10 + num_tokens)), num_tokens, computed,
                                             num_tokens - computed, table, SamplingSpec(temperature=0.0))])


def test_the_data_plane_refuses_a_freed_block_where_its_group_still_reads(gpt_oss_runner):
    # 20 tokens, 19 cached: a query at 19 reads 8 .. 19 in the sliding group (blocks 2-4), all in the full one
    table = [0, X, 1, X, 2, 3, 4, 5, 6, 7]
    with pytest.raises(PlanError, match=r"table entry 0 \(group 0\)"):
        gpt_oss_runner.execute(_plan(1, [X] + table[1:], 20, 19))
    with pytest.raises(PlanError, match=r"table entry 5 \(group 1\)"):
        gpt_oss_runner.execute(_plan(2, table[:5] + [X] + table[6:], 20, 19))
    with pytest.raises(PlanError, match="10 table entries"):
        gpt_oss_runner.execute(_plan(3, table[:8], 20, 19))
    assert len(gpt_oss_runner.execute(_plan(4, table, 20, 19)).sampled) == 1
