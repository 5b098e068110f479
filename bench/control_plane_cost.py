"""The control plane's own work per step, without a model: what overlap (--async-scheduling) could
hide behind the data plane's step at most.

    python bench/control_plane_cost.py                 # decode steps of 1, 8, 64, 128 sequences
    python bench/control_plane_cost.py --batches 64
    python bench/control_plane_cost.py --batches 1,8,64 --structured   # + every sequence json_schema-constrained

The real Engine drives bench/_fake_engine.FakeRunner (same contract, no tensors). Each part is timed
in this process's CPU time (time.process_time), so that other processes on a shared machine do not
count: schedule (which builds and records the plan), msgpack (encode the plan, decode it, encode and decode a
result of the same size, as the two ends of the link do), and applying the result (Scheduler.update's
prefix caching, the output processor's tokens, stop checks and detokenizing, Scheduler.apply, metrics). The whole step is the engine's step less the fake data
plane's own work (its sampling is the data plane's, not ours). Compare it with the data plane's step
time of the same batch (bench/overhead.py).

--structured adds, per batch, the same decode batch with every sequence constrained by a JSON schema
(xgrammar over SmolLM2's tokenizer, as the server compiles it): the fake data plane samples only
tokens the masks allow, so each matcher accepts every token. Timed apart: building the step's masks
(Matchers.step_masks, before the plan is sent) and the matchers' acceptance of the sampled tokens
(Matchers.accept, part of applying the result); msgpack then carries 6 KiB of mask per sequence.
A sequence ends when its grammar does (the fake gives EOS, the only token allowed then), so the
constrained batch may shrink over the steps: "masks/step" is the mean number actually built. The
fake's uniform draw among the allowed tokens rarely closes a string (few tokens hold a quote), so
most steps are inside the first string values: structural positions are a small part of the mix.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fake_engine as T  # noqa: E402

from control_plane.sampling_params import SamplingParams  # noqa: E402
from control_plane.structured import Constraint, Matchers  # noqa: E402
from shared import protocol as P  # noqa: E402

# what a tool-calling or extraction request asks for: strings (the long part), a number, an enum, a list
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "summary": {"type": "string"},
                         "year": {"type": "integer"}, "kind": {"enum": ["book", "film", "song"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "summary", "year", "kind", "tags"], "additionalProperties": False}
CONSTRAINT = Constraint("json_schema", json.dumps(SCHEMA))


def grammar_backend(tokenizer, vocab_size: int = 49152):
    """One xgrammar backend for every engine of the run (its tokenizer info takes seconds to build);
    raises ImportError without xgrammar."""
    import xgrammar  # noqa: F401  (GrammarBackend would turn its absence into a 400-style error)
    from control_plane.structured import GrammarBackend
    return GrammarBackend(tokenizer, vocab_size, [T.EOS_ID])


async def measure(batch: int, context: int, steps: int, tokenizer, grammar=None) -> dict[str, float]:
    """`grammar`: a GrammarBackend to constrain every sequence with CONSTRAINT, or None."""
    dp = T.FakeRunner(num_blocks=batch * (context + steps + 64) // 16 + 64, block_size=16)
    engine = T.make_engine(dp, max_num_seqs=max(batch, 1), budget=max(512, batch), tokenizer=tokenizer)
    if grammar is not None:
        engine.outputs.matchers = Matchers(grammar)
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(T.FIRST_SYNTHETIC_TOKEN, 49152) for _ in range(context)]
        params = (SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True) if grammar is None else
                  SamplingParams(max_tokens=1000, temperature=0.0, constraint=CONSTRAINT))
        engine.add_request(f"r{i}", prompt, params)
    matchers = engine.outputs.matchers
    parts = {"schedule": 0.0, "msgpack": 0.0, "apply result": 0.0, "fake data plane": 0.0,
             "step_masks": 0.0, "accept": 0.0}
    counts = {"masks": 0, "rejected": 0}
    sched = engine.scheduler
    clock = time.process_time

    def timed(name, fn):
        def run(*a, **kw):
            t = clock()
            out = fn(*a, **kw)
            parts[name] += clock() - t
            return out
        return run
    step = engine.client.step

    async def wire_step(plan, timeout):
        t = clock()
        plan = P.decode(P.encode(P.STEP_PLAN, plan))[1]
        parts["msgpack"] += clock() - t
        t = clock()
        result = await step(plan, timeout)
        parts["fake data plane"] += clock() - t
        t = clock()
        result = P.decode(P.encode(P.STEP_RESULT, result))[1]
        parts["msgpack"] += clock() - t
        return result
    engine.client.step = wire_step
    while True:   # prefill until every sequence decodes
        plan = sched.schedule()
        plan.token_masks = engine.outputs.masks(plan)
        result = await wire_step(plan, 0)
        sched.update(plan, result)
        sched.apply(engine.outputs.process(result))
        scheduled = plan.new_seqs + plan.cached_seqs
        if len(scheduled) == batch and sum(s.num_new_tokens for s in scheduled) == batch:
            break
    # wrapped on the instances: Engine.step calls these
    sched.schedule = timed("schedule", sched.schedule)
    for obj, name in ((sched, "update"), (engine.outputs, "process"), (sched, "apply")):
        setattr(obj, name, timed("apply result", getattr(obj, name)))
    if matchers is not None:   # wrapped on the instance: the engine and the output processor call these
        masks_of, accept = timed("step_masks", matchers.step_masks), timed("accept", matchers.accept)

        def step_masks(seqs):
            masks = masks_of(seqs)
            counts["masks"] += len(masks)
            return masks

        def accept_token(seq_id, token_id):
            ok = accept(seq_id, token_id)
            counts["rejected"] += not ok
            return ok
        matchers.step_masks, matchers.accept = step_masks, accept_token
    for k in parts:
        parts[k] = 0.0
    t0 = clock()
    for _ in range(steps):
        await engine.step()
    total = clock() - t0 - parts.pop("fake data plane")
    if counts["rejected"]:
        raise AssertionError(f"the matchers rejected {counts['rejected']} sampled tokens: the fake data plane "
                             "did not honor the masks, so the figures would not be structured output's")
    return {**{k: 1000 * v / steps for k, v in parts.items()}, "whole step": 1000 * total / steps,
            "masks/step": counts["masks"] / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--structured", action="store_true",
                    help="also time the same batches with every sequence JSON-schema constrained")
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if min(batches) < 1 or args.steps < 1 or args.context < 1:
        ap.error("--batches, --steps and --context must be positive")
    from control_plane.launch import load_tokenizer
    from shared.config import default_model_path
    tokenizer = load_tokenizer(default_model_path())   # the real detokenizer: part of applying a result
    print(f"control plane CPU time per decode step (ms; process time, context {args.context}, {args.steps} steps; "
          f"load average {os.getloadavg()[0]:.1f})")
    cols = ["schedule", "msgpack", "apply result", "whole step"]
    print(f"{'batch':>6} " + " ".join(f"{c:>13}" for c in cols))
    plain = {}
    for b in batches:
        plain[b] = r = asyncio.run(measure(b, args.context, args.steps, tokenizer))
        print(f"{b:>6} " + " ".join(f"{r[c]:>13.2f}" for c in cols))
    if args.structured:
        print_structured(batches, args, tokenizer, plain)
    return 0


def print_structured(batches: list[int], args, tokenizer, plain: dict) -> None:
    print()
    try:
        grammar = grammar_backend(tokenizer)
    except ImportError as exc:
        print(f"structured output: not run: xgrammar is not importable ({exc}); pip install 'pagedserve[structured]'")
        return
    from importlib.metadata import version
    print(f"structured output: every sequence constrained by a JSON schema ({len(CONSTRAINT.value)} characters; "
          f"xgrammar {version('xgrammar')}); same decode batches, ms per step (apply result includes accept)")
    print("(the fake draws uniformly among the allowed tokens, so most steps sit inside a string value)")
    cols = ["step_masks", "accept", "msgpack", "apply result", "whole step"]
    print(f"{'batch':>6} {'masks/step':>10} " + " ".join(f"{c:>13}" for c in cols) + f" {'unconstrained':>13}")
    for b in batches:
        r = asyncio.run(measure(b, args.context, args.steps, tokenizer, grammar))
        print(f"{b:>6} {r['masks/step']:>10.1f} " + " ".join(f"{r[c]:>13.3f}" for c in cols)
              + f" {plain[b]['whole step']:>13.3f}")


if __name__ == "__main__":
    sys.exit(main())
