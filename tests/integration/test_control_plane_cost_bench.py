"""bench/control_plane_cost.py's structured-output line: the fake data plane samples only what a
plan's token masks allow (the real sampler's bit layout), a sequence whose grammar has ended gets
EOS and stops, and the measurement runs on a small constrained batch with positive times."""
import asyncio
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import _fake_engine as T  # noqa: E402
import control_plane_cost as C  # noqa: E402

from control_plane.sampling_params import SamplingParams  # noqa: E402
from control_plane.structured import Constraint, Matchers  # noqa: E402
from shared.protocol import NewSequence, SamplingSpec, StepPlan  # noqa: E402

VOCAB = 64


def mask_of(allowed, vocab: int = VOCAB) -> bytes:
    """Bit j of byte k allows token 8k + j (little-endian bits, as data_plane/sampler.py reads them)."""
    packed = bytearray(-(-vocab // 32) * 4)
    for t in allowed:
        packed[t // 8] |= 1 << (t % 8)
    return bytes(packed)


def new_seq(seq_id: int, n: int = 1) -> NewSequence:
    return NewSequence(seq_id, [5, 6, 7, 8], 4, 0, 4, [seq_id], SamplingSpec(temperature=1.0, n=n))


def sample(plan: StepPlan) -> dict[int, list[int]]:
    dp = T.FakeRunner(num_blocks=8, block_size=16, vocab_size=VOCAB)
    result = dp.execute(plan)
    tokens: dict[int, list[int]] = {}
    for s in result.sampled:
        tokens.setdefault(s.seq_id, []).append(s.token_id)
    return tokens


def test_fake_data_plane_draws_only_allowed_tokens():
    few = {7, 40, 63}
    plan = StepPlan(1, [new_seq(1, n=6), new_seq(2), new_seq(3), new_seq(4)],
                    token_masks=[(1, mask_of(few)), (2, mask_of([T.EOS_ID])), (3, mask_of([9]))])
    tokens = sample(plan)
    assert len(tokens[1]) == 6 and set(tokens[1]) <= few
    assert len(set(tokens[1])) > 1          # drawn from its generator, not always the first allowed id
    assert tokens[2] == [T.EOS_ID]          # a grammar that has ended allows only EOS
    assert tokens[3] == [9]                 # byte 1, bit 1: big-endian bits would read token 14
    assert T.FIRST_SYNTHETIC_TOKEN <= tokens[4][0] < VOCAB   # no mask: unconstrained as before


@pytest.mark.parametrize("mask, message", [(bytes(4), "does not cover"), (bytes(8), "allows no token")])
def test_fake_data_plane_refuses_bad_masks(mask, message):
    with pytest.raises(ValueError, match=message):
        sample(StepPlan(1, [new_seq(1)], token_masks=[(1, mask)]))


@pytest.fixture(scope="module")
def grammar(smol_tokenizer):
    return C.grammar_backend(smol_tokenizer)


def test_grammar_end_gives_eos_and_stops(smol_tokenizer, grammar, caplog):
    """A choice grammar ends after a few tokens: the engine then masks everything but EOS, the fake
    data plane says EOS, and the request stops with a text the grammar allows."""
    dp = T.FakeRunner(num_blocks=64, block_size=16)
    engine = T.make_engine(dp, max_num_seqs=4, tokenizer=smol_tokenizer)
    engine.outputs.matchers = Matchers(grammar)
    choices = Constraint("choice", '["yes please", "no thanks"]')
    reqs = [engine.add_request(f"r{i}", [100 + i] * 6, SamplingParams(max_tokens=50, seed=i, constraint=choices))
            for i in range(3)]

    async def run():
        steps = 0
        while engine.scheduler.has_work():
            await engine.step()
            steps += 1
            assert steps < 50, "the constrained requests never ended"
    asyncio.run(run())
    assert "outside its grammar" not in caplog.text
    for req in reqs:
        outs = []
        while not req.queue.empty():
            outs.append(req.queue.get_nowait())
        outs = [o for o in outs if o.index == 0]          # not the end-of-stream marker
        assert "".join(o.text for o in outs) in ("yes please", "no thanks")
        assert outs[-1].finished and outs[-1].finish_reason == "stop", outs[-1]
        assert outs[-1].token_ids == [T.EOS_ID]


def test_structured_measure_small_batch(smol_tokenizer, grammar):
    r = asyncio.run(C.measure(4, 16, 6, smol_tokenizer, grammar))   # raises if a matcher rejected a token
    assert r["masks/step"] == 4
    for part in ("step_masks", "accept", "msgpack", "apply result", "whole step"):
        assert r[part] > 0, (part, r)
    assert r["whole step"] > r["step_masks"]
