"""The control plane's own work per step, without a model: what overlap (--async-scheduling) could
hide behind the data plane's step at most.

    python bench/control_plane_cost.py                 # decode steps of 1, 8, 64, 128 sequences
    python bench/control_plane_cost.py --batches 64

The real Engine drives bench/_fake_engine.FakeDataPlane (same contract, no tensors). Each part is timed
in this process's CPU time (time.process_time), so that other processes on a shared machine do not
count: schedule, build_plan + commit, msgpack (encode the plan, decode it, encode and decode a
result of the same size, as the two ends of the link do), and applying the result (prefix caching,
tokens, stop checks, detokenizing, metrics). Compare the total with the data plane's step time of
the same batch (bench/overhead.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fake_engine as T  # noqa: E402

from control_plane import engine as engine_mod  # noqa: E402
from control_plane.sampling_params import SamplingParams  # noqa: E402
from shared import protocol as P  # noqa: E402


async def measure(batch: int, context: int, steps: int, tokenizer) -> dict[str, float]:
    dp = T.FakeDataPlane(num_blocks=batch * (context + steps + 64) // 16 + 64, block_size=16)
    engine = T.make_engine(dp, max_num_seqs=max(batch, 1), budget=max(512, batch), tokenizer=tokenizer)
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(T.FIRST_SYNTHETIC_TOKEN, 49152) for _ in range(context)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    parts = {"schedule": 0.0, "build+commit": 0.0, "msgpack": 0.0, "apply result": 0.0}
    sched, build, outputs = engine.scheduler.schedule, engine_mod.build_plan, engine.outputs.apply
    clock = time.process_time

    def timed(name, fn):
        def run(*a, **kw):
            t = clock()
            out = fn(*a, **kw)
            parts[name] += clock() - t
            return out
        return run
    step = dp.step

    async def wire_step(plan, timeout):
        t = clock()
        plan = P.decode(P.encode(P.STEP_PLAN, plan))[1]
        parts["msgpack"] += clock() - t
        result = await step(plan, timeout)
        t = clock()
        result = P.decode(P.encode(P.STEP_RESULT, result))[1]
        parts["msgpack"] += clock() - t
        return result
    engine.client.step = wire_step
    while True:   # prefill until every sequence decodes
        out = engine.scheduler.schedule()
        engine._step_id += 1
        plan = build(engine._step_id, out, engine.scheduler.bm)
        engine.scheduler.commit(out)
        result = await wire_step(plan, 0)
        engine.scheduler.on_step_done(out)
        engine.outputs.apply(result.sampled)
        if len(out.scheduled) == batch and sum(s.num_new_tokens for s in out.scheduled) == batch:
            break
    engine.scheduler.schedule = timed("schedule", sched)
    engine_mod.build_plan = timed("build+commit", build)
    engine.scheduler.commit = timed("build+commit", engine.scheduler.commit)
    engine.outputs.apply = timed("apply result", outputs)
    engine.scheduler.on_step_done = timed("apply result", engine.scheduler.on_step_done)
    for k in parts:
        parts[k] = 0.0
    t0 = clock()
    for _ in range(steps):
        await engine.step()
    total = clock() - t0
    engine_mod.build_plan = build
    return {**{k: 1000 * v / steps for k, v in parts.items()}, "whole step": 1000 * total / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    from control_plane.launch import load_tokenizer
    from shared.config import default_model_path
    tokenizer = load_tokenizer(default_model_path())   # the real detokenizer: part of applying a result
    print(f"control plane CPU time per decode step (ms; process time, context {args.context}, {args.steps} steps; "
          f"load average {os.getloadavg()[0]:.1f})")
    cols = ["schedule", "build+commit", "msgpack", "apply result", "whole step"]
    print(f"{'batch':>6} " + " ".join(f"{c:>13}" for c in cols))
    for b in (int(x) for x in args.batches.split(",")):
        r = asyncio.run(measure(b, args.context, args.steps, tokenizer))
        print(f"{b:>6} " + " ".join(f"{r[c]:>13.2f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
