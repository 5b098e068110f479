"""Every number is checked in one place, and the arithmetic that remains cannot overflow (D1, D2,
D3's validation, D8, D9): pure functions, no server."""
import json
import math

import numpy as np
import pytest

from control_plane.beam_search import BeamSearch, length_divisor
from control_plane.sampling_params import (INT64_MAX, MAX_LENGTH_PENALTY, SamplingParams, ValidationError,
                                           check_for_model, parse_sampling)
from shared import protocol as P
from tests.helpers import small_engine

NUMERIC = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_tokens", "priority", "n", "best_of", "length_penalty", "logprobs"]


def refused(body, **kw) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        parse_sampling(body, **kw)
    return info.value


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("value", [2**64, -(2**64), 2**70, json.loads("1e400"), json.loads("-1e400"), math.nan])
def test_no_numeric_field_takes_a_value_past_64_bits_or_infinity(name, value):
    err = refused({name: value, "use_beam_search": name == "length_penalty", "n": 2} if name == "length_penalty"
                  else {name: value})
    assert err.param == name and err.code in ("invalid_value", "invalid_type")


def test_d1_length_penalty_is_bounded_and_the_beam_math_cannot_overflow():
    assert refused({"use_beam_search": True, "n": 2, "length_penalty": 2000}).param == "length_penalty"
    assert parse_sampling({"length_penalty": MAX_LENGTH_PENALTY}).length_penalty == MAX_LENGTH_PENALTY
    # the scoring itself, given any exponent, ends finite or ±0 / ±inf, never raises
    for lp in (2000.0, -2000.0, 1e308, MAX_LENGTH_PENALTY):
        for length in (1, 2, 8191):
            d = length_divisor(length, lp)
            assert isinstance(d, np.float32) and not math.isnan(d)
    beam = BeamSearch(2, 2000.0, False, 3, frozenset({2}))
    beam.start(0)
    for step in range(3):
        for sid in list(beam.scores):
            beam.report(sid, [(2, -0.1), (5, -0.5), (6, -1.0), (7, -2.0)])
        choices, done = beam.step({sid: [] for sid in beam.scores})
        beam.scores = {i: c.score for i, c in enumerate(choices)}
        if done:
            break
    assert beam.best(2) and all(not math.isnan(h.score) for h in beam.best(2))


def test_d2_stop_token_ids_past_any_vocabulary_are_refused_before_the_wire():
    err = refused({"stop_token_ids": [2**70]})
    assert err.param == "stop_token_ids"
    assert refused({"stop_token_ids": list(range(5000))}).param == "stop_token_ids"   # too many
    params = parse_sampling({"stop_token_ids": [60000]})
    with pytest.raises(ValidationError) as info:
        check_for_model(params, 49152, [2])
    assert info.value.code == "invalid_token_id"
    # what passes both checks fits msgpack's ints
    ok = parse_sampling({"stop_token_ids": [5], "seed": INT64_MAX, "top_k": 2**31 - 1})
    check_for_model(ok, 49152, [2])
    P.encode(P.STEP_PLAN, P.StepPlan(1, [P.NewSequence(1, [1], 1, 0, 1, [0], ok.spec([2]))]))


def test_d3_a_beam_that_would_ask_for_more_candidates_than_the_vocabulary_is_refused():
    params = parse_sampling({"use_beam_search": True, "n": 2, "stop_token_ids": list(range(1000))})
    with pytest.raises(ValidationError, match="vocabulary of 1500"):
        check_for_model(params, 1500, [2])
    check_for_model(params, 49152, [2])   # (1 + 1001) * 2 candidates: fine for a real vocabulary


def test_d9_a_tiny_temperature_is_greedy():
    for t in (1e-308, 5e-324, 1e-30, 9e-6):
        assert parse_sampling({"temperature": t}).temperature == 0.0
    assert parse_sampling({"temperature": 1e-4}).temperature == 1e-4


def test_penalties_that_would_overflow_the_logits_are_refused():
    for value in (1e-300, 1e300, 0.0):
        assert refused({"repetition_penalty": value}).param == "repetition_penalty"
    for name in ("presence_penalty", "frequency_penalty"):
        assert refused({name: 1e300}).param == name


def test_d8_admission_knows_the_pool_with_block_rounding_and_the_watermark():
    engine = small_engine()
    with pytest.raises(ValidationError) as info:
        engine.validate_request([5] * 511, SamplingParams(max_tokens=1))
    assert info.value.code == "context_length_exceeded" and "KV blocks" in info.value.message
    with pytest.raises(ValidationError):
        engine.validate_request([5] * 500, SamplingParams(max_tokens=12))
    engine.validate_request([5] * 490, SamplingParams(max_tokens=6))   # 31 blocks of 32: fits
    # several sequences each need their own tail
    with pytest.raises(ValidationError, match="for 4 sequences"):
        engine.validate_request([5] * 300, SamplingParams(max_tokens=100, n=4))
    engine.validate_request([5] * 300, SamplingParams(max_tokens=20, n=2))
