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
(bench/kv_blocks_cost.py measures it): per-block and per-table-entry work is done in C where it can be
(map, zip, dict.update, array, set.intersection), so that a full pool stays under a millisecond.
"""
from __future__ import annotations

import base64
import json
import sys
import time
from array import array
from operator import attrgetter

from aiohttp import web

FREE, CACHED, WINDOW, MANY = ".", "C", "W", "+"   # never a character of REF_CHARS
REF_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"   # a held block's ref count, when under 36
_block_id = attrgetter("block_id")


def _int32_base64(values: array) -> str:
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


# bytes of ref counts (clamped to 255) -> state characters: 0 free, 1..35 the count, 36 and more MANY
_STATE_OF_REF = bytes((FREE + REF_CHARS[1:]).encode("ascii") + MANY.encode("ascii") * (256 - len(REF_CHARS)))
_CACHED, _WINDOW = CACHED.encode("ascii")[0], WINDOW.encode("ascii")[0]


def _states(pool, refs: list[int], with_window: bool) -> str:
    """One character per block (see the top): in C from the ref counts, then a loop over the free
    blocks that hold a cached prefix and, with a sliding window, over the free blocks."""
    raw = bytes(refs) if max(refs) < 256 else bytes([min(r, 255) for r in refs])
    state = bytearray(raw.translate(_STATE_OF_REF))
    if pool.cached:
        for block_id in set(map(_block_id, pool.cached.values())).intersection(pool.free_block_ids()):
            state[block_id] = _CACHED
    if with_window:
        blocks = pool.blocks
        for block_id in pool.free_block_ids():
            if blocks[block_id].freed_by_window:
                state[block_id] = _WINDOW
    return state.decode("ascii")


def _pool(pool, tables: dict, out_tables: dict, with_window: bool = False) -> dict | None:
    """The pool's blocks, and each table of `tables` as block ids (into `out_tables`)."""
    if pool is None:
        return None
    blocks = pool.blocks
    refs = [b.ref_count for b in blocks]
    holder = array("i", [-1]) * len(blocks)
    shared: dict[int, list[int]] = {}
    shared_ids = {i for i, r in enumerate(refs) if r > 1} if pool.num_shared else ()
    for seq_id, table in tables.items():
        if None in table:   # placeholders: blocks that left the sliding window
            ids = [-1 if b is None else b.block_id for b in table]
            for block_id in ids:
                if block_id >= 0:
                    holder[block_id] = seq_id
        else:
            ids = [b.block_id for b in table]
            for block_id in ids:
                holder[block_id] = seq_id
        out_tables[seq_id] = ids
        if shared_ids:
            for block_id in shared_ids.intersection(ids):
                holders = shared.get(block_id)
                if holders is None:
                    shared[block_id] = [seq_id]
                else:
                    holders.append(seq_id)
    return {"blocks": len(blocks), "used": len(blocks) - pool.num_free, "state": _states(pool, refs, with_window),
            "holder": _int32_base64(holder), "shared": shared}


def _seqs(scheduler, device_tables: dict, cpu_tables: dict) -> dict:
    seqs = [*scheduler.running, *scheduler.waiting]
    swapped = [s for group in scheduler.swapped for s in group]
    state = "r" * len(scheduler.running) + "w" * len(scheduler.waiting) + "s" * len(swapped)
    seqs += swapped
    flat: list[int] = []            # every table, one after the other
    lengths = []
    empty: list[int] = []
    for s in seqs:
        table = device_tables.get(s.seq_id) or cpu_tables.get(s.seq_id, empty)
        flat += table
        lengths.append(len(table))
    return {"id": [s.seq_id for s in seqs], "request": [s.request_id for s in seqs],
            "sample": [s.sample_index for s in seqs], "state": state,
            "prompt": [s.num_prompt_tokens for s in seqs], "output": [s.num_output_tokens for s in seqs],
            "table_len": lengths, "tables": _int32_base64(array("i", flat))}


def snapshot(scheduler, num_generated: int, block_size: int) -> dict:
    """One engine's pools, sequences and counters at this moment."""
    bm = scheduler.bm
    device_tables: dict[int, list[int]] = {}
    cpu_tables: dict[int, list[int]] = {}
    device = _pool(bm.pool, bm.tables, device_tables, with_window=bm.sliding_window > 0)
    cpu = _pool(bm.cpu_pool, bm.cpu_tables, cpu_tables)
    load = scheduler.load()
    stats = {"running": load.running, "waiting": load.waiting, "swapped": load.swapped,
             "kv_usage": load.kv_usage, "cpu_kv_usage": load.cpu_kv_usage, "generated_tokens": num_generated,
             "preemptions": {"recompute": scheduler.num_preemptions, "swap": scheduler.num_swap_preemptions}}
    return {"block_size": block_size, "time": time.time(), "device": device, "cpu": cpu,
            "seqs": _seqs(scheduler, device_tables, cpu_tables), "stats": stats}


def of_engine(engine) -> dict:
    """An Engine's snapshot, or a Router's: one per replica."""
    replicas = getattr(engine, "engines", None)
    if replicas is not None:
        return {"replicas": [of_engine(e) for e in replicas]}
    return snapshot(engine.scheduler, engine.stats.num_generated, engine.hs.block_size)


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def handler(engine):
    async def kv_blocks(request: web.Request) -> web.Response:
        return web.json_response(of_engine(engine), dumps=_dumps)
    return kv_blocks
