"""Structured output stays exact whatever happens to a constrained sequence (issue [12], item 4):
greedy and seeded sampled requests, with n and best_of, give the same tokens alone, under recompute
preemption, under swap preemption, and across data-plane restarts mid-generation.

The real engine drives the real model runner in-process, on a tiny random Llama with SmolLM2's
tokenizer (xgrammar compiles against a real tokenizer): a random model writes valid JSON only where
the masks force it, so every output that parses against the schema shows the masks took effect.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from control_plane.dp_client import DataPlaneDead
from control_plane.engine import Engine
from control_plane.sampling_params import SamplingParams
from control_plane.structured import Constraint, Matchers
from shared.config import ControlPlaneConfig
from tests.helpers import make_runner, paged_model
from tests.runner_link import RunnerLink

BLOCK_SIZE = 4
MAX_TOKENS = 64
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Oslo", "Lima", "Quito"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["sun", "rain", "snow"]},
                                  "minItems": 2, "maxItems": 4}},
          "required": ["city", "days", "tags"], "additionalProperties": False}
CONSTRAINT = Constraint("json_schema", json.dumps(SCHEMA))


def jobs(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded sampled, seeded n=2 and best_of: all constrained, all with their own prompt."""
    def params(**kw):
        return SamplingParams(max_tokens=MAX_TOKENS, constraint=CONSTRAINT, **kw)
    kinds = [params(temperature=0.0), params(temperature=1.0, seed=11), params(temperature=0.9, seed=5, n=2),
             params(temperature=1.0, seed=9, n=2, best_of=3), params(temperature=0.0),
             params(temperature=1.0, seed=3, top_p=0.9)]
    return [(tokenizer.encode(f"Weather report number {i}, as JSON:"), p) for i, p in enumerate(kinds)]


def check_schema(value) -> None:
    assert set(value) == {"city", "days", "tags"}, value
    assert value["city"] in ("Oslo", "Lima", "Quito") and 1 <= value["days"] <= 99, value
    assert 2 <= len(value["tags"]) <= 4 and set(value["tags"]) <= {"sun", "rain", "snow"}, value


@pytest.fixture(scope="module")
def model(smol_tokenizer):
    return paged_model(seed=0, vocab_size=len(smol_tokenizer), hidden=64)


@pytest.fixture(scope="module")
def grammar(model, smol_tokenizer):
    """An engine's xgrammar backend (tokenizer info, compiled schema), made once for every engine here."""
    engine, _ = make_engine(model, (smol_tokenizer, None), num_blocks=64)
    return smol_tokenizer, engine._grammar_matchers().backend


class RestartingClient(RunnerLink):
    """The in-process link over a runner that can die. At the steps in `die_at` the data plane computes
    the plan (its sequences advance, a token is sampled) and then dies before its result comes back;
    the next handshake answers from a new runner with an empty pool, as a restarted data plane would."""

    def __init__(self, make, die_at=()):
        super().__init__(make())
        self.make = make
        self.die_at = set(die_at)
        self.num_steps = 0
        self.deaths = 0

    async def step(self, plan, timeout):
        self.num_steps += 1
        result = await super().step(plan, timeout)
        if self.num_steps in self.die_at:
            self.deaths += 1
            self.runner = self.make()
            raise DataPlaneDead(f"killed after step {plan.step_id} (its result is lost)")
        return result


def make_engine(model, grammar, num_blocks, mode="recompute", swap_blocks=0, die_at=(), overlap=False):
    """`grammar`: (tokenizer, a GrammarBackend to share, or None for the engine's own); `overlap`: plan
    each step while the one before runs (async scheduling, the server's default)."""
    client = RestartingClient(lambda: make_runner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                                  swap_blocks=swap_blocks), die_at)
    config = ControlPlaneConfig(model="tiny", max_num_batched_tokens=32, preemption_mode=mode,
                                async_scheduling=overlap)
    tokenizer, backend = grammar
    engine = Engine(config, client, client.runner.handshake(), tokenizer)
    if backend is not None:
        engine.outputs.matchers = Matchers(backend)
    return engine, client


def assert_matchers_follow_the_tokens(engine) -> None:
    """Each live constrained sequence's matcher allows exactly what a matcher replayed over the
    sequence's own output tokens allows: no step lost or preempted has moved it."""
    matchers = engine.outputs.matchers
    for seq_id, req in engine.owners.items():
        if req.params.constraint is None:
            continue
        seq = req.seqs[seq_id]
        replayed = matchers.backend.matcher(matchers.compiled[seq_id], seq.output_token_ids)
        mask = matchers.mask(seq_id)
        replayed.fill_next_token_bitmask(matchers._bitmask, 0)
        assert mask == matchers._bitmask.numpy().tobytes(), f"sequence {seq_id}'s matcher left its tokens"


def run(engine, client, job_list):
    """Runs the jobs to the end; per job, its choices as (text, token ids, finish reason)."""
    stats = {"preempted_groups": 0, "in_flight_at_death": 0}
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        # a live sequence the data plane is told to forget was preempted or swapped out
        victims = [engine.owners[seq_id] for seq_id in plan.forget_seq_ids if seq_id in engine.owners]
        stats["preempted_groups"] += any(req.params.best_of > 1 for req in victims)
        return plan
    engine.scheduler.schedule = recording_schedule

    async def drive():
        reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(job_list)]
        while any(not r.finished for r in reqs):
            deaths = client.deaths
            live_constrained = sum(0 < req.seqs[s].num_output_tokens for s, req in engine.owners.items())
            await engine._guarded(engine.step())
            if client.deaths > deaths:
                stats["in_flight_at_death"] += live_constrained
                assert_matchers_follow_the_tokens(engine)
            engine.scheduler.check_integrity()
        return reqs
    try:
        reqs = asyncio.run(drive())
    finally:
        engine.scheduler.schedule = schedule
    results = []
    for r in reqs:
        choices: dict[int, list] = {}
        while not r.queue.empty():
            out = r.queue.get_nowait()
            if out.index < 0:
                continue
            assert out.error is None, out.error
            text, ids, reason = choices.get(out.index, ("", [], None))
            choices[out.index] = (text + out.text, ids + out.token_ids, out.finish_reason or reason)
        results.append([choices[i] for i in sorted(choices)])
    bm = engine.scheduler.bm
    assert not engine.owners and not bm.tables and bm.num_free_blocks() == bm.pool.num_blocks
    assert engine.outputs.matchers.by_seq == {}, "a matcher outlived its sequence"
    return results, stats


@pytest.fixture(scope="module")
def alone(model, grammar, smol_tokenizer):
    """Each job run by itself, one after the other, on a roomy pool: no preemption."""
    engine, client = make_engine(model, grammar, num_blocks=512)
    results = []
    for job in jobs(smol_tokenizer):
        out, _ = run(engine, client, [job])
        results.extend(out)
    assert engine.scheduler.num_preemptions == engine.scheduler.num_swap_preemptions == 0
    # every prompt fits the step budget of 32, so every plan that computes anything samples: with masks
    assert all(plan.token_masks for plan in client.plans if plan.new_seqs or plan.cached_seqs)
    return results


def test_alone_every_choice_is_valid_json_and_sampling_is_seeded(alone, smol_tokenizer):
    job_list = jobs(smol_tokenizer)
    for (_, params), choices in zip(job_list, alone):
        assert len(choices) == params.n
        for text, ids, reason in choices:
            assert reason == "stop", (text, reason)
            check_schema(json.loads(text))
    # seeds make the samples differ from the greedy output and from each other
    assert alone[1] != alone[0] and alone[2][0] != alone[2][1]


def test_planning_ahead_gives_the_outputs_of_each_request_alone(alone, model, grammar, smol_tokenizer):
    # with overlap a constrained sequence sits out the step planned while its token is drawn (its next
    # mask follows from that token), and the others' steps go ahead meanwhile
    engine, client = make_engine(model, grammar, num_blocks=512, overlap=True)
    together, _ = run(engine, client, jobs(smol_tokenizer))
    assert client.sent_ahead > 0, "no plan was sent while another one ran"
    assert together == alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_outputs_of_each_request_alone(alone, model, grammar, smol_tokenizer, mode):
    # 56 blocks of 4 tokens: each request fits alone (best_of=3 needs 53), all nine sequences need ~120
    engine, client = make_engine(model, grammar, num_blocks=56, mode=mode,
                                 swap_blocks=256 if mode == "swap" else 0)
    crowded, stats = run(engine, client, jobs(smol_tokenizer))
    sched = engine.scheduler
    if mode == "swap":
        assert sched.num_swap_preemptions > 0 and sched.num_preemptions == 0
    else:   # no swap pool: even the groups of n and best_of recompute
        assert sched.num_preemptions > 0 and sched.num_swap_preemptions == 0
    assert stats["preempted_groups"] > 0, "no request with parallel samples was preempted"
    assert crowded == alone


def test_data_plane_restarts_mid_generation_keep_the_outputs(alone, model, grammar, smol_tokenizer):
    undisturbed, client = make_engine(model, grammar, num_blocks=512)
    expected, _ = run(undisturbed, client, jobs(smol_tokenizer))
    assert expected == alone
    # the data plane dies three times: during the prompts, early in the JSON, and deep in it
    engine, client = make_engine(model, grammar, num_blocks=512, die_at=(2, 9, 25))
    restarted, stats = run(engine, client, jobs(smol_tokenizer))
    assert client.deaths == 3
    assert stats["in_flight_at_death"] > 0, "no constrained sequence was mid-output when the data plane died"
    assert restarted == expected
