"""GET /debug/kv/blocks (control_plane/kv_blocks.py) and the built-in page's routes (control_plane/page.py):
the snapshot decodes to exactly the block manager's state (holders, ref counts, cached and window-freed
blocks, tables in logical order on both pools), and the page is served, public under --api-key while the
data is not, and gone with --no-ui."""
import asyncio
import base64
import json
import os
import sys
from array import array

import aiohttp
from aiohttp import web

from control_plane import kv_blocks
from control_plane.api import make_app
from control_plane.block_manager import BlockManager
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence, SeqStatus
from tests.helpers import small_engine
from tests.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "page-key"


def int32s(b64: str) -> list[int]:
    values = array("i")
    values.frombytes(base64.b64decode(b64))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def tables_of(seqs: dict) -> dict[int, list[int]]:
    flat, out, at = int32s(seqs["tables"]), {}, 0
    for seq_id, length in zip(seqs["id"], seqs["table_len"]):
        out[seq_id] = flat[at:at + length]
        at += length
    return out


def seq(tokens: int, status: SeqStatus, sample: int = 0, request: str = "r-0") -> Sequence:
    s = Sequence(request, list(range(100, 100 + tokens)), tokens, SamplingParams(), sample_index=sample)
    s.status = status
    return s


def test_the_snapshot_is_the_block_managers_state_on_both_pools():
    bm = BlockManager(16, 4, num_cpu_blocks=8)
    sched = Scheduler(bm, 8, 64)
    parent, waiting = seq(10, SeqStatus.RUNNING), seq(5, SeqStatus.WAITING, request="w-0")
    bm.grow(parent.seq_id, 10)                                   # blocks 0, 1, 2
    bm.cache_computed_blocks(parent.seq_id, parent.token_ids, 8)   # 0 and 1 hashed
    children = [seq(10, SeqStatus.RUNNING, sample=i) for i in (1, 2)]
    for c in children:
        bm.fork(parent.seq_id, c.seq_id)                      # all three share 0, 1, 2
    bm.grow(children[0].seq_id, 13, write_from=10)            # copy-on-write of block 2 into 3, and block 4
    gone = seq(8, SeqStatus.RUNNING, request="gone-0")
    bm.grow(gone.seq_id, 8)                                   # 5, 6: hashed, then freed: cached free blocks
    bm.cache_computed_blocks(gone.seq_id, list(range(500, 508)), 8)
    bm.free(gone.seq_id)
    swapped = [seq(6, SeqStatus.SWAPPED, request="s-0")]
    bm.grow(swapped[0].seq_id, 6)
    bm.swap_out([swapped[0].seq_id])
    sched.running += [parent, *children]
    sched.waiting.append(waiting)
    sched.swapped.append(swapped)
    sched.num_swap_preemptions = 1
    sched.check_integrity()

    snap = json.loads(kv_blocks._dumps(kv_blocks.snapshot(sched, 42, 4)))
    dev, cpu, seqs = snap["device"], snap["cpu"], snap["seqs"]
    assert dev["blocks"] == 16 and dev["used"] == 16 - bm.num_free_blocks() == 5
    assert cpu["blocks"] == 8 and cpu["used"] == 2
    assert seqs["state"] == "rrrws"
    assert seqs["id"] == [parent.seq_id, children[0].seq_id, children[1].seq_id, waiting.seq_id, swapped[0].seq_id]
    assert seqs["sample"] == [0, 1, 2, 0, 0] and seqs["request"][3:] == ["w-0", "s-0"]
    tables = tables_of(seqs)
    for s in (parent, *children):
        assert tables[s.seq_id] == bm.block_ids(s.seq_id)     # logical order
    assert tables[waiting.seq_id] == []
    assert tables[swapped[0].seq_id] == [b.block_id for b in bm.cpu_tables[swapped[0].seq_id]]
    # per block: state (ref count or why free), holder, every holder of a shared block
    holder = int32s(dev["holder"])
    for block in bm.pool.blocks:
        i, ref = block.block_id, block.ref_count
        holders = sorted(s for s, t in bm.tables.items() if any(b is not None and b.block_id == i for b in t))
        if ref:
            assert dev["state"][i] == str(ref) and holder[i] in holders
            assert sorted(dev["shared"].get(str(i), holders)) == holders and (str(i) in dev["shared"]) == (ref > 1)
        else:
            assert dev["state"][i] == ("C" if block.block_hash is not None else ".") and holder[i] == -1
    assert dev["state"].count("C") == 2
    assert dev["shared"]["0"] == sorted(dev["shared"]["0"]) and len(dev["shared"]["0"]) == 3
    cpu_holder = int32s(cpu["holder"])
    assert cpu["state"] == "11......"
    assert [cpu_holder[b] for b in tables[swapped[0].seq_id]] == [swapped[0].seq_id] * 2
    assert snap["stats"] == {"running": 3, "waiting": 1, "swapped": 1, "kv_usage": bm.usage(),
                             "cpu_kv_usage": bm.cpu_usage(), "generated_tokens": 42,
                             "preemptions": {"recompute": 0, "swap": 1}, "state_slots": 0, "state_slots_used": 0}


def test_blocks_that_left_the_window_are_marked_and_ref_counts_past_35_are_spelled_out():
    bm = BlockManager(8, 4, sliding_window=6)
    sched = Scheduler(bm, 64, 64)
    s = seq(14, SeqStatus.RUNNING)
    bm.grow(s.seq_id, 14)
    bm.free_outside_window(s.seq_id, 14)                       # blocks 0 and 1 leave the window
    forks = [seq(14, SeqStatus.RUNNING, sample=i) for i in range(1, 40)]   # ref counts 12 and 32 ("c", "w")
    for f in forks:
        bm.fork(s.seq_id, f.seq_id)                            # blocks 2, 3: 40 holders each
    sched.running += [s, *forks]
    snap = kv_blocks.snapshot(sched, 0, 4)
    assert snap["device"]["state"] == "WW++...."
    assert len(snap["device"]["shared"][2]) == 40
    assert tables_of(snap["seqs"])[s.seq_id] == [-1, -1, 2, 3]
    bm.grow(seq(4, SeqStatus.RUNNING).seq_id, 24)              # 4..7, then 0, 1 again: no longer window-freed
    assert kv_blocks.snapshot(sched, 0, 4)["device"]["state"][:2] == "11"


def test_the_cost_bench_fills_the_pools_and_measures_the_handler():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import kv_blocks_cost
    sched = kv_blocks_cost.busy_scheduler(96, 128, swapped=2, max_seqs=12)
    sched.check_integrity()
    snap = kv_blocks.snapshot(sched, 0, 16)
    assert snap["device"]["used"] >= 48 and snap["device"]["shared"] and snap["cpu"]["used"] > 0
    assert snap["seqs"]["state"].count("s") == 6


def serve(test, api_key=None, ui=True):
    engine = small_engine()
    engine.config.api_key = api_key
    engine.config.ui = ui

    async def run():
        runner = web.AppRunner(make_app(engine), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                return await test(session)
        finally:
            await runner.cleanup()
    return asyncio.run(run())


async def get(session, path, key=None):
    async with session.get(path, headers={"Authorization": f"Bearer {key}"} if key else {}) as resp:
        return resp.status, resp.headers, await resp.text()


def test_the_page_is_public_under_an_api_key_and_the_data_is_not():
    async def run(session):
        status, headers, html = await get(session, "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert 'data-auth="key"' in html and "script-src 'self'" in headers["Content-Security-Policy"]
        for asset in ("/ui/app.js", "/ui/style.css"):
            assert (await get(session, asset))[0] == 200
        assert (await get(session, "/debug/kv/blocks"))[0] == 401
        status, _, body = await get(session, "/debug/kv/blocks", KEY)
        assert status == 200 and json.loads(body)["device"]["blocks"] == 32
        status, _, body = await get(session, "/ui/../api.py", KEY)   # only the page's own files
        assert status == 404 and "import" not in body
    serve(run, api_key=KEY)


def test_without_a_key_the_page_does_not_ask_for_one():
    async def run(session):
        status, _, html = await get(session, "/")
        assert status == 200 and 'data-auth="none"' in html
    serve(run)


def test_no_ui_leaves_the_page_out_but_keeps_the_data():
    async def run(session):
        for path in ("/", "/ui/app.js"):
            status, _, body = await get(session, path, KEY)
            assert status == 404 and json.loads(body)["error"]["code"] == "unknown_url"
        assert (await get(session, "/"))[0] == 401          # without the page, / is not public either
        assert (await get(session, "/debug/kv/blocks", KEY))[0] == 200
    serve(run, api_key=KEY, ui=False)


def test_every_ref_count_has_its_own_character_apart_from_the_free_states():
    chars = [chr(c) for c in kv_blocks._STATE_OF_REF]
    assert chars[0] == kv_blocks.FREE and chars[36:] == [kv_blocks.MANY] * 220
    assert chars[1:36] == list(kv_blocks.REF_CHARS[1:])
    free_states = {kv_blocks.FREE, kv_blocks.CACHED, kv_blocks.WINDOW, kv_blocks.MANY}
    assert len(free_states) == 4 and not free_states & set(chars[1:36])


def test_a_router_answers_one_snapshot_per_replica():
    from control_plane.router import Router
    engines = [small_engine(num_blocks=8), small_engine(num_blocks=12)]
    snap = kv_blocks.of_engine(Router(engines))
    assert [r["device"]["blocks"] for r in snap["replicas"]] == [8, 12]
    assert all(r["device"]["state"] == "." * r["device"]["blocks"] for r in snap["replicas"])
