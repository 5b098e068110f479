"""GET /debug/kv/blocks: one snapshot of both KV pools, block by block, for the built-in page's
block map (control_plane/static/). Read-only, and built in one go on the event loop, so that it is
one consistent moment of the block manager: the page's coloured cells are exactly the blocks in use.

One engine's answer (a Router's is {"replicas": [one such answer per replica]}):

    {"block_size": 16, "time": 1700000000.0,
     "device": {"blocks": 8, "used": 3,
                "state": "131.CW..",      per block: its ref count, or why it is free (below)
                "holder": "BwAAAAcAAAAIAAAA/////...",   per block a sequence holding it, -1 none
                "shared": {"1": [7, 8, 9]}},           block id -> every holder, for ref count > 1
     "cpu": {...the same for the CPU swap pool...} or null without one,
     "seqs": {"id": [7, 8, 9, 12], "request": ["9f0c...-0", ...], "sample": [0, 1, 2, 0],
              "state": "rrrw",                        r running, w waiting, s swapped (to the CPU pool)
              "prompt": [40, 40, 40, 9], "output": [5, 5, 4, 0],   token counts
              "table_len": [2, 2, 2, 0], "tables": "AAAAAAEAAAABAAAAAgAAAAEAAAAFAAAA"},   see below
     "stats": {"running", "waiting", "swapped", "kv_usage", "cpu_kv_usage", "generated_tokens",
               "state_slots", "state_slots_used",     the state pool (0 and 0 without state layers)
               "preemptions": {"recompute", "swap"}}}

Block state, one character per block: a held block's ref count ("1".."9", "a".."z" for 10..35, "+"
above: its `shared` entry has every holder); a free block is "." (empty), "C" (it still holds a
cached prefix, which a later prompt may reuse) or "W" (it left the sliding window of the sequence
that held it). `holder` is base64 of little-endian int32, one per block (the page decodes it into an
Int32Array). Sequences are columns, one entry per sequence, running first, then waiting, then swapped;
`tables` holds their block tables one after the other (base64 of little-endian int32, `table_len`
entries each), each in logical order, -1 for a block that left the sliding window; a swapped
sequence's table holds CPU-pool block ids.

The page polls this at most twice a second; its cost at the default pool is in docs/observability.md
(bench/kv_blocks_cost.py measures it): past reading the ref counts and the tables out of the block
manager's objects, the per-block work is numpy's and bytes.translate's, so that a full pool stays
around a millisecond.
"""
from __future__ import annotations

import base64
import json
import time
from operator import attrgetter

import numpy as np

from aiohttp import web

FREE, CACHED, WINDOW, MANY = ".", "C", "W", "+"   # never a character of REF_CHARS
REF_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"   # a held block's ref count, when under 36
_block_id = attrgetter("block_id")


def _base64(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<i4", copy=False).tobytes()).decode("ascii")


# bytes of ref counts (clamped to 255) -> state characters: 0 free, 1..35 the count, 36 and more MANY
_STATE_OF_REF = bytes((FREE + REF_CHARS[1:]).encode("ascii") + MANY.encode("ascii") * (256 - len(REF_CHARS)))
_CACHED, _WINDOW = CACHED.encode("ascii")[0], WINDOW.encode("ascii")[0]


def _states(pool, refs: np.ndarray, with_window: bool) -> str:
    """One character per block (see the top): in C from the ref counts, then a loop over the free blocks
    that hold a cached prefix and, with a sliding window, over the free blocks."""
    state = bytearray(np.minimum(refs, 255).astype(np.uint8).tobytes().translate(_STATE_OF_REF))
    if pool.cached:
        for block_id in set(map(_block_id, pool.cached.values())).intersection(pool.free_block_ids()):
            state[block_id] = _CACHED
    if with_window:
        blocks = pool.blocks
        for block_id in pool.free_block_ids():
            if blocks[block_id].freed_by_window:
                state[block_id] = _WINDOW
    return state.decode("ascii")


def _pool(pool, entries: np.ndarray, owners: np.ndarray, with_window: bool = False) -> dict | None:
    """The pool's blocks; `entries` holds the block ids of every table on this pool (-1: a placeholder),
    `owners` the sequence of each entry."""
    if pool is None:
        return None
    refs = np.array([b.ref_count for b in pool.blocks], dtype=np.int64)
    live = entries >= 0
    holder = np.full(len(refs), -1, dtype=np.int64)
    holder[entries[live]] = owners[live]                 # the last of a shared block's holders
    shared: dict[int, list[int]] = {}
    if pool.num_shared:
        sharing = live.copy()
        sharing[live] = refs[entries[live]] > 1
        for block_id, seq_id in zip(entries[sharing].tolist(), owners[sharing].tolist()):
            holders = shared.get(block_id)
            if holders is None:
                shared[block_id] = [seq_id]
            else:
                holders.append(seq_id)
    return {"blocks": len(refs), "used": len(refs) - pool.num_free, "state": _states(pool, refs, with_window),
            "holder": _base64(holder), "shared": shared}


def snapshot(scheduler, num_generated: int, block_size: int) -> dict:
    """One engine's pools, sequences and counters at this moment."""
    bm = scheduler.bm
    on_device = [*scheduler.running, *scheduler.waiting]
    swapped = [s for group in scheduler.swapped for s in group]
    seqs = on_device + swapped
    flat: list[int] = []            # every table, one after the other: the device's, then the CPU pool's
    lengths = []
    windowed = bm.windowed
    for tables, group in ((bm.tables, on_device), (bm.cpu_tables, swapped)):
        for s in group:
            table = tables.get(s.seq_id, ())
            if windowed and None in table:   # placeholders: blocks that left the sliding window
                flat += [-1 if b is None else b.block_id for b in table]
            else:
                flat += [b.block_id for b in table]
            lengths.append(len(table))
    entries = np.array(flat, dtype=np.int64)
    owners = np.repeat(np.array([s.seq_id for s in seqs], dtype=np.int64), lengths)
    split = sum(lengths[:len(on_device)])
    load = scheduler.load()
    stats = {"running": load.running, "waiting": load.waiting, "swapped": load.swapped,
             "kv_usage": load.kv_usage, "cpu_kv_usage": load.cpu_kv_usage, "generated_tokens": num_generated,
             "state_slots": load.state_slots, "state_slots_used": load.state_slots_used,
             "preemptions": {"recompute": scheduler.num_preemptions, "swap": scheduler.num_swap_preemptions}}
    # with several layer groups a table interleaves theirs: entry i * groups + g is group g's block i
    return {"block_size": block_size, "group_reaches": bm.reaches, "time": time.time(),
            "device": _pool(bm.pool, entries[:split], owners[:split], with_window=windowed),
            "cpu": _pool(bm.cpu_pool, entries[split:], owners[split:]),
            "seqs": {"id": [s.seq_id for s in seqs], "request": [s.request_id for s in seqs],
                     "sample": [s.sample_index for s in seqs],
                     "state": "r" * len(scheduler.running) + "w" * len(scheduler.waiting) + "s" * len(swapped),
                     "prompt": [s.num_prompt_tokens for s in seqs], "output": [s.num_output_tokens for s in seqs],
                     "table_len": lengths, "tables": _base64(entries)},
            "stats": stats}


def of_engine(engine) -> dict:
    """An Engine's snapshot, or a Router's: one per replica."""
    replicas = getattr(engine, "engines", None)
    if replicas is not None:
        return {"replicas": [of_engine(e) for e in replicas]}
    return snapshot(engine.scheduler, engine.stats.num_generated, engine.hs.block_size)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), check_circular=False)


def handler(engine):
    async def kv_blocks(request: web.Request) -> web.Response:
        return web.json_response(of_engine(engine), dumps=_dumps)
    return kv_blocks
