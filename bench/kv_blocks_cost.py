"""What one GET /debug/kv/blocks costs the control plane, at the default pools of the default model
(SmolLM2-135M in float32: 1 GiB of device KV = 1456 blocks of 16 tokens, a 2 GiB CPU swap pool =
2912 blocks), filled as a busy server fills them:

    python bench/kv_blocks_cost.py                  # 1456 device blocks, 2912 CPU blocks
    python bench/kv_blocks_cost.py --swapped -1     # ... and the CPU pool full of swapped requests
    python bench/kv_blocks_cost.py --device-blocks 8192 --cpu-blocks 4096

The real block manager and scheduler hold 128 running sequences (requests of n = 3 parallel samples
whose 3-block prompts share one 2-block system prefix through the prefix cache, each sample with its own
decode blocks) until the device pool is full, plus `--swapped` requests in the CPU pool (8, or until it
is full), plus 64 waiting ones, plus free blocks that still hold cached prefixes. Then the endpoint's
handler (the snapshot, its JSON and the aiohttp response) runs `--rounds` rounds of `--calls` calls; the
figure is the median round's CPU time of this process per call (time.process_time), so that other
processes on a shared machine count as little as they can.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from control_plane import kv_blocks  # noqa: E402
from control_plane.block_manager import BlockManager  # noqa: E402
from control_plane.sampling_params import SamplingParams  # noqa: E402
from control_plane.scheduler import Scheduler  # noqa: E402
from control_plane.sequence import Sequence, SeqStatus  # noqa: E402

BLOCK = 16


def busy_scheduler(device_blocks: int, cpu_blocks: int, swapped: int, max_seqs: int = 128) -> Scheduler:
    rng = random.Random(0)
    bm = BlockManager(device_blocks, BLOCK, num_cpu_blocks=cpu_blocks)
    sched = Scheduler(bm, max_seqs, 512)
    system = [rng.randrange(50000) for _ in range(2 * BLOCK)]   # the shared system prompt
    req = 0

    def request(state: SeqStatus) -> list[Sequence] | None:
        nonlocal req
        prompt = system + [rng.randrange(50000) for _ in range(BLOCK + 5)]
        seqs = [Sequence(f"{req:032x}-0", list(prompt), len(prompt), SamplingParams(n=3), sample_index=i)
                for i in range(3)]
        req += 1
        parent = seqs[0]
        bm.match_prefix(parent.seq_id, parent.token_ids)
        if bm.grow(parent.seq_id, len(prompt)) is None:
            bm.free(parent.seq_id)
            return None
        bm.cache_computed_blocks(parent.seq_id, parent.token_ids, len(prompt))
        for child in seqs[1:]:
            bm.fork(parent.seq_id, child.seq_id)
        out = rng.randrange(100, 260)   # each sample's own decode tokens
        for s in seqs:
            s.token_ids += [rng.randrange(50000) for _ in range(out)]
            if bm.grow(s.seq_id, len(s.token_ids), write_from=len(prompt)) is None:
                for t in seqs:
                    bm.free(t.seq_id)
                return None
            s.status = state
        return seqs

    while len(sched.running) + 3 <= max_seqs:   # running until the device pool or the batch is full
        group = request(SeqStatus.RUNNING)
        if group is None:
            break
        sched.running += group
    # swapped: the last running requests moved to the CPU pool (swapped < 0: until it is full)
    while bm.cpu_pool is not None and len(sched.swapped) != swapped:
        if len(sched.running) < 3 or not bm.can_swap_out([s.seq_id for s in sched.running[-3:]]):
            break
        group = sched.running[-3:]
        del sched.running[-3:]
        bm.swap_out([s.seq_id for s in group])
        for s in group:
            s.status = SeqStatus.SWAPPED
        sched.swapped.append(group)
        group = request(SeqStatus.RUNNING)      # the room it left goes to new running requests
        if group is not None:
            sched.running += group
    for i in range(64):                         # waiting requests hold no blocks
        sched.waiting.append(Sequence(f"w{i:031x}-0", [1] * 40, 40, SamplingParams()))
    return sched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-blocks", type=int, default=1456)
    parser.add_argument("--cpu-blocks", type=int, default=2912)
    parser.add_argument("--swapped", type=int, default=8,
                        help="requests (of 3 sequences) swapped to the CPU pool; -1: until it is full")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    sched = busy_scheduler(args.device_blocks, args.cpu_blocks, args.swapped)
    sched.check_integrity()
    engine = SimpleNamespace(scheduler=sched, stats=SimpleNamespace(num_generated=0),
                             hs=SimpleNamespace(block_size=BLOCK))
    handle = kv_blocks.handler(engine)

    async def run() -> tuple[list[float], int]:
        resp = await handle(None)               # warm-up, and the size of one answer
        rounds = []
        for _ in range(args.rounds):
            start = time.process_time()
            for _ in range(args.calls):
                await handle(None)
            rounds.append((time.process_time() - start) / args.calls)
        return sorted(rounds), len(resp.body)

    rounds, size = asyncio.run(run())
    bm = sched.bm
    snap = kv_blocks.of_engine(engine)
    print(f"device {bm.pool.num_blocks} blocks ({snap['device']['used']} used, {bm.num_shared_blocks} shared, "
          f"{snap['device']['state'].count('C')} cached free), CPU {args.cpu_blocks} blocks "
          f"({snap['cpu']['used'] if snap['cpu'] else 0} used); {len(sched.running)} running, "
          f"{sum(len(g) for g in sched.swapped)} swapped, {len(sched.waiting)} waiting sequences")
    print(f"GET /debug/kv/blocks: {rounds[len(rounds) // 2] * 1e3:.3f} ms of CPU per call (median of {args.rounds} "
          f"rounds of {args.calls} calls; fastest round {rounds[0] * 1e3:.3f} ms, slowest {rounds[-1] * 1e3:.3f} ms), "
          f"{size / 1024:.1f} KiB of JSON")


if __name__ == "__main__":
    main()
