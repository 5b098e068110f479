"""Maps sequences to blocks: block tables, growth, sharing (fork, copy-on-write), prefix cache,
and, for a model with state layers, each sequence's slot of the state pool (control_plane/state_slots.py).

The scheduler asks it questions ("can this sequence grow to N tokens?") and gets answers:
new block ids, or None when there is no room now.

Prefix cache: a full, computed block is hashed on its tokens chained on its parent's hash,

    h0 = hash((None, tokens[0:B]))   h1 = hash((h0, tokens[B:2B]))   h2 = hash((h1, tokens[2B:3B]))

so equal hashes mean equal prefixes (lookups also compare the tokens). A new sequence reuses
the longest run of cached full blocks, but never one holding its last known token: that
token must be computed to produce logits, and it is never written into a shared block.

Sliding window: when every layer of the model attends to at most the last W positions (the
handshake's `sliding_window`), a query at position p reads keys p - W < j <= p only. A sequence
whose next query sits at position c (its computed tokens) never reads a block again once the
block lies wholly before c - W + 1:

    W = 6, block size 4, c = 14:   [0 1 2 3][4 5 6 7][8 9 10 11][12 13 _ _]
                                    dead      dead     live: 9 .. 13 are read by the query at 14

    dead blocks = (c - W + 1) // block size        (here 9 // 4 = 2)

Such a block goes back to the pool (free_outside_window) and its table entry becomes None, a
placeholder that keeps the logical indices of the blocks after it; the data plane gets -1 there
(FREED_BLOCK_ID) when a table is sent in full, and never reads it. A placeholder is never swapped,
copied or shared (a fork copies it as a placeholder). A freed block keeps its prefix-cache hash
until the pool hands it out again, like any free block, so it can still serve a later prefix. A
prefix hit of k blocks needs only the blocks that a query at position k * block size reads: the
blocks before them may be gone, and the new table gets placeholders for them (match_prefix).

Layer groups: where the layers differ in how far back they read (GPT-OSS alternates sliding-window and
full layers), the data plane splits them into groups, each with its reach (`group_reaches`: 0 for the whole
context; data_plane/kv_pool.py), and a sequence keeps a table per group. The tables are held interleaved,
as one list: entry i * G + g is group g's block i (G groups). Everything above holds per group: a window
group's dead blocks become placeholders while the full groups keep theirs, a copy-on-write copies each
group's shared block, and a prefix hit needs every group's blocks for it (each group's blocks are cached
under its own keys). With one group (`sliding_window`, 0 or the window of every layer) the table is the
group's.

State slots: with `num_state_slots` (a model whose layers keep a per-sequence state), a sequence takes
a slot when it gets its table (grow fails, changing nothing, when none is free) and gives it back in
free(); a fork takes one for the child. Prefix caching is off for such a model: a cached block holds
KV, not the state after it, so a prefix hit could not skip the state layers' work.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from control_plane.block_pool import Block, BlockPool
from control_plane.state_slots import StateSlots
from shared.protocol import FREED_BLOCK_ID, NO_STATE_SLOT


def chain_block_hashes(token_ids: list[int], block_size: int, num_blocks: int, start: int = 0,
                       parent: int | None = None):
    """(index, hash, key) of full blocks start .. num_blocks-1, each hash chained on the one before;
    `parent` is the hash of block start-1. The router hashes prompts the same way for affinity."""
    for i in range(start, num_blocks):
        key = (parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        parent = hash(key)
        yield i, parent, key


@dataclass
class Growth:
    new_block_ids: list[int] = field(default_factory=list)   # appended to the table
    # copy-on-write: (logical index, shared block copied from, private block copied to)
    copies: list[tuple[int, int, int]] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_cpu_blocks: int = 0,
                 sliding_window: int = 0, num_state_slots: int = 0, group_reaches: list[int] | None = None):
        # per layer group, the positions its layers see, their own included (0: all); one group without
        # `group_reaches`, whose layers see at most `sliding_window` positions
        self.reaches = list(group_reaches) if group_reaches else [sliding_window]
        assert all(r >= 0 for r in self.reaches), f"reaches must be >= 0 (0: everything), got {self.reaches}"
        self.num_groups = len(self.reaches)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.cpu_tables: dict[int, list[Block]] = {}   # swapped-out sequences
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        # a swapped sequence's state waits in a CPU slot (as many as device slots, with a CPU pool)
        self.cpu_state_slots = StateSlots(num_state_slots) if num_state_slots and num_cpu_blocks else None
        self._state_swaps: tuple[list, list] = ([], [])   # (out, in) slot pairs not yet in a plan
        self.enable_prefix_caching = enable_prefix_caching and self.state_slots is None
        # a None entry: a block that left the sliding window and went back to the pool; with several groups,
        # entry i * num_groups + g is group g's block i
        self.tables: dict[int, list[Block | None]] = {}
        # per sequence: (leading blocks already hashed, hash of the last of them)
        self._hashed: dict[int, tuple[int, int | None]] = {}
        self.prefix_queries = 0                 # tokens looked up in the prefix cache
        self.prefix_hits = 0                    # of which found
        self.num_cow_copies = 0
        self.num_window_freed = 0               # table entries freed because they left the window

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def entries_needed(self, num_tokens: int) -> int:
        """Table entries (one block each, every group's) that hold `num_tokens` tokens."""
        return self.num_groups * self.blocks_needed(num_tokens)

    @property
    def windowed(self) -> bool:
        """Whether some group frees blocks that leave its window (tables may hold placeholders)."""
        return any(self.reaches)

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def group_blocks(self, token_lists: list[list[int]], chunk: int) -> int:
        """Device blocks that the sequences of one request (parallel samples, beams), recomputed
        together, hold at most once all have caught up: each one's blocks, less the full blocks of its
        longest common prefix with an earlier one when the prefix cache shares them, and with a sliding
        window no more than a query and a chunk of `chunk` new tokens read. Counting every sequence
        whole would ask for more than the pool has for a group that ran in it, sharing its prompt."""
        total = 0
        for i, tokens in enumerate(token_lists):
            blocks = self.blocks_needed(len(tokens))
            if self.enable_prefix_caching and i:
                common = max(_common_prefix(tokens, other) for other in token_lists[:i])
                # the block holding its last token is never shared (see the top)
                blocks -= min(common, len(tokens) - 1) // self.block_size
            for reach in self.reaches:
                total += min(blocks, self.blocks_needed(reach + chunk) + 1) if reach else blocks
        return total

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_shared_blocks(self) -> int:
        """Device blocks held by more than one sequence (forks, prefix-cache hits)."""
        return self.pool.num_shared

    def cpu_usage(self) -> float:
        return self.cpu_pool.usage() if self.cpu_pool else 0.0

    def block_ids(self, seq_id: int) -> list[int]:
        return [FREED_BLOCK_ID if b is None else b.block_id for b in self.tables.get(seq_id, ())]

    def num_dead_blocks(self, num_computed: int, group: int = 0) -> int:
        """Leading blocks of a group that no query at position num_computed or later reads (see the top)."""
        reach = self.reaches[group]
        if not reach:
            return 0
        return max(0, num_computed - reach + 1) // self.block_size

    # --- growth ---------------------------------------------------------------------
    def _cow_entries(self, table: list[Block | None], write_from: int | None) -> list[int]:
        """Table entries (one per group) of the shared blocks that writing from `write_from` on would touch."""
        if write_from is None:
            return []
        first = write_from // self.block_size * self.num_groups
        return [e for e in range(first, min(first + self.num_groups, len(table)))
                if table[e] is not None and table[e].ref_count > 1]

    def blocks_to_grow(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> int:
        """Free blocks that grow() would take for the same arguments."""
        table = self.tables.get(seq_id, [])
        missing = max(0, self.entries_needed(num_tokens) - len(table))
        return missing + len(self._cow_entries(table, write_from))

    def slots_to_grow(self, seq_id: int) -> int:
        """State slots that grow() would take (1 for a sequence without a table, with state layers)."""
        return int(self.state_slots is not None and seq_id not in self.tables)

    def num_free_slots(self) -> int:
        """Free state slots; without state layers, more than could ever be asked for."""
        return self.state_slots.num_free if self.state_slots is not None else 1 << 62

    def state_slot(self, seq_id: int) -> int:
        """The sequence's state slot, NO_STATE_SLOT without state layers."""
        return self.state_slots.slot_of(seq_id) if self.state_slots is not None else NO_STATE_SLOT

    def grow(self, seq_id: int, num_tokens: int, write_from: int | None = None, reserve: int = 0) -> Growth | None:
        """Make the table hold `num_tokens` tokens, writing from position `write_from` on (a shared
        block written into is first copied). Returns what changed, or None, changing nothing, when
        fewer than the blocks needed plus `reserve` are free, or a new table finds no free state slot."""
        if self.blocks_to_grow(seq_id, num_tokens, write_from) + reserve > self.pool.num_free:
            return None
        if self.slots_to_grow(seq_id) and self.state_slots.take(seq_id) is None:
            return None
        table = self.tables.setdefault(seq_id, [])
        growth = Growth()
        for entry in self._cow_entries(table, write_from):
            shared = table[entry]
            private = self.pool.allocate()
            self.pool.free(shared)
            table[entry] = private
            growth.copies.append((entry, shared.block_id, private.block_id))
            self.num_cow_copies += 1
        missing = max(0, self.entries_needed(num_tokens) - len(table))
        for block in self.pool.allocate_many(missing) or []:
            table.append(block)
            growth.new_block_ids.append(block.block_id)
        return growth

    def can_fork(self) -> bool:
        return self.state_slots is None or self.state_slots.num_free > 0

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write when either writes); with state
        layers it takes a slot, into which the parent's state is copied (the caller checked can_fork)."""
        assert child_id not in self.tables, f"sequence {child_id} already has blocks"
        table = self.tables[parent_id]
        if self.state_slots is not None and not self.state_slots.fork(parent_id, child_id):
            raise RuntimeError(f"no free state slot to fork sequence {parent_id}")
        for block in table:
            if block is not None:
                self.pool.incref(block)
        self.tables[child_id] = list(table)
        if parent_id in self._hashed:
            self._hashed[child_id] = self._hashed[parent_id]

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (device or CPU), last first, so that a prefix's tail is
        evicted before its head."""
        for block in reversed(self.tables.pop(seq_id, [])):
            if block is not None:
                self.pool.free(block)
        if self.state_slots is not None:
            self.state_slots.give_back(seq_id)
        if self.cpu_state_slots is not None:
            self.cpu_state_slots.give_back(seq_id)
        for block in reversed(self.cpu_tables.pop(seq_id, [])):
            if block is not None:
                self.cpu_pool.free(block)
        self._hashed.pop(seq_id, None)

    def free_outside_window(self, seq_id: int, num_computed: int) -> int:
        """Gives back the blocks of the sequence that no query from position `num_computed` on reads
        (a block shared with a fork stays in the pool until the fork lets go of it too); their
        entries become placeholders. Returns how many entries were freed now.

        Safe at any time: a plan already sent runs on the data plane before any later plan that
        could reuse the block, and the sequence's own later queries all sit at num_computed or after."""
        table = self.tables.get(seq_id)
        if table is None or not self.windowed:
            return 0
        n = self.num_groups
        dead = [min(self.num_dead_blocks(num_computed, g), len(table) // n) for g in range(n)]
        freed = 0
        for i in range(max(dead)):   # front first: the oldest context goes first, like a prefix's tail last
            for g in range(n):
                entry = i * n + g
                if i < dead[g] and table[entry] is not None:
                    self.pool.free(table[entry])
                    table[entry].freed_by_window = table[entry].ref_count == 0
                    table[entry] = None
                    freed += 1
        self.num_window_freed += freed
        return freed

    # --- swapping -------------------------------------------------------------------------
    @staticmethod
    def _unique_blocks(tables: list[list[Block | None]]) -> int:
        return len({b.block_id for table in tables for b in table if b is not None})

    def num_blocks_of(self, seq_ids: list[int], on_cpu: bool = False) -> int:
        """Distinct blocks held by these sequences (shared ones once)."""
        tables = self.cpu_tables if on_cpu else self.tables
        return self._unique_blocks([tables.get(s, []) for s in seq_ids])

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        if self.cpu_pool is None or self.state_slots is not None and self.cpu_state_slots.num_free < len(seq_ids):
            return False   # (each swapped sequence's state takes a CPU slot)
        return self.num_blocks_of(seq_ids) <= self.cpu_pool.num_free

    def _move(self, seq_ids, src_tables, dst_tables, src_pool, dst_pool) -> list[tuple[int, int]]:
        """Moves the tables of a group of sequences to the other pool, keeping their sharing: a block
        shared by several of them becomes one block, with the same ref count, on the other side."""
        moved: dict[int, Block] = {}
        pairs = []
        for seq_id in seq_ids:
            new_table = []
            for block in src_tables.pop(seq_id):
                if block is None:   # freed by the window: nothing to move, the placeholder stays
                    new_table.append(None)
                    continue
                target = moved.get(block.block_id)
                if target is None:
                    target = dst_pool.allocate()
                    moved[block.block_id] = target
                    pairs.append((block.block_id, target.block_id))
                else:
                    dst_pool.incref(target)
                src_pool.free(block)
                new_table.append(target)
            dst_tables[seq_id] = new_table
        return pairs

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """(device block, CPU block) pairs; the caller checked can_swap_out."""
        assert self.can_swap_out(seq_ids), "not enough free CPU blocks"
        for seq_id in seq_ids:
            self._hashed.pop(seq_id, None)   # hashing resumes from scratch after the swap-in
            if self.state_slots is not None:
                self._state_swaps[0].append(self.state_slots.move_out(seq_id, self.cpu_state_slots))
        return self._move(seq_ids, self.tables, self.cpu_tables, self.pool, self.cpu_pool)

    def swap_in(self, seq_ids: list[int], reserve: int = 0) -> list[tuple[int, int]] | None:
        """(CPU block, device block) pairs, or None when the device lacks room (plus `reserve`)."""
        if self.num_blocks_of(seq_ids, on_cpu=True) + reserve > self.pool.num_free or \
                len(seq_ids) > self.num_free_slots():
            return None
        if self.state_slots is not None:
            self._state_swaps[1].extend(self.cpu_state_slots.move_out(s, self.state_slots) for s in seq_ids)
        return self._move(seq_ids, self.cpu_tables, self.tables, self.cpu_pool, self.pool)

    def take_state_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state slots swapped out and in since the last plan, for the next one."""
        swaps, self._state_swaps = self._state_swaps, ([], [])
        return swaps

    # --- prefix cache -------------------------------------------------------------------
    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """For a sequence without blocks: share the longest cached prefix; returns its length in tokens.

        Without a window a prefix of k blocks needs all k cached. With one, only the blocks that a
        query at position k * block size reads (see the top): those before are placeholders, so a
        prefix whose head was evicted still serves when its tail is cached. With several groups, every
        group must serve it."""
        assert seq_id not in self.tables, f"sequence {seq_id} already has blocks"
        if not self.enable_prefix_caching:
            return 0
        # never the block holding the last token: it must be computed, and never written when shared
        max_blocks = (len(token_ids) - 1) // self.block_size
        # the chain's hashes, made as far as a lookup needs them (a full group stops at its first miss)
        links, chain = chain_block_hashes(token_ids, self.block_size, max_blocks), []
        usable = [True] * (max_blocks + 1)       # usable[k]: every group serves a prefix of k blocks
        found = [[None] * max_blocks for _ in self.reaches]   # found[g][i]: group g's cached block i
        for g, reach in enumerate(self.reaches):
            run_start = 0                        # first block of the run of cached blocks ending at i
            for i in range(max_blocks):
                if i == len(chain):
                    chain.append(next(links))
                _, block_hash, key = chain[i]
                block = found[g][i] = self.pool.lookup(*self._group_key(g, block_hash, key))
                if block is None:
                    if not reach:                # every later prefix would need this block
                        usable[i + 1:] = [False] * (max_blocks - i)
                        break
                    run_start = i + 1
                if run_start > self.num_dead_blocks((i + 1) * self.block_size, g):
                    usable[i + 1] = False
        best = max(k for k, ok in enumerate(usable) if ok)
        table: list[Block | None] = []
        for i in range(best):
            for g in range(self.num_groups):
                table.append(None if i < self.num_dead_blocks(best * self.block_size, g) else found[g][i])
        for block in table:
            if block is not None:
                self.pool.incref(block)
        self.prefix_queries += len(token_ids)
        self.prefix_hits += best * self.block_size
        if best:
            self.tables[seq_id] = table
            self._hashed[seq_id] = (best, chain[best - 1][1])
        return best * self.block_size

    @staticmethod
    def _group_key(group: int, block_hash: int, key: tuple) -> tuple[int, tuple]:
        """The prefix cache's (hash, key) of a group's block: the first group's are the chain's own."""
        if not group:
            return block_hash, key
        return hash((group, block_hash)), (group, key)

    def cache_computed_blocks(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Registers the sequence's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self.tables[seq_id]
        n = self.num_groups
        done, parent = self._hashed.get(seq_id, (0, None))
        full = min(num_computed // self.block_size, len(table) // n)
        for i, block_hash, key in chain_block_hashes(token_ids, self.block_size, full, done, parent):
            for g in range(n):
                block = table[i * n + g]
                # (None: freed by the window before it was registered; the chain goes on past it)
                if block is not None and block.block_hash is None:
                    # False when another sequence cached the same contents first: this copy stays private
                    self.pool.register(block, *self._group_key(g, block_hash, key))
            parent = block_hash
        if full > done:
            self._hashed[seq_id] = (full, parent)

    def check_integrity(self) -> None:
        references = Counter(b.block_id for table in self.tables.values() for b in table if b is not None)
        self.pool.check_integrity(references)
        if self.cpu_pool is not None:
            cpu_refs = Counter(b.block_id for table in self.cpu_tables.values() for b in table if b is not None)
            self.cpu_pool.check_integrity(cpu_refs)
        n = self.num_groups
        for table in (*self.tables.values(), *self.cpu_tables.values()):
            assert len(table) % n == 0, f"a table of {len(table)} entries for {n} groups"
            for g, reach in enumerate(self.reaches):
                placeholders = [i for i, b in enumerate(table[g::n]) if b is None]
                assert reach or not placeholders, f"a placeholder in group {g}, which has no sliding window"
                # placeholders form a prefix of the group's dead part: never a block a query still reads
                assert placeholders == list(range(len(placeholders))), f"placeholders not leading: {placeholders}"
        assert not set(self.tables) & set(self.cpu_tables), "a sequence holds device and CPU blocks at once"
        if self.state_slots is not None:
            self.state_slots.check_integrity(set(self.tables))
        if self.cpu_state_slots is not None:
            self.cpu_state_slots.check_integrity(set(self.cpu_tables))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
