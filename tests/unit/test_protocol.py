import msgpack
import pytest

from shared import protocol as P


def test_step_plan_round_trip():
    plan = P.StepPlan(
        step_id=7,
        new_seqs=[P.NewSequence(3, [1, 2, 3, 4], 3, 0, 4, [5, 9],
                                P.SamplingSpec(temperature=0.7, top_k=5, seed=11, stop_token_ids=[2], logprobs=2))],
        cached_seqs=[P.CachedSequence(1, 1), P.CachedSequence(2, 1, [17], [42], [(1, 12)])],
        forget_seq_ids=[0],
        swap_out=[(4, 0)], swap_in=[(1, 6)], copies=[(8, 12)])
    kind, back = P.decode(P.encode(P.STEP_PLAN, plan))
    assert kind == P.STEP_PLAN
    assert back == plan


def test_result_and_handshake_round_trip():
    result = P.StepResult(3, [P.SampledToken(1, 42, -0.5, [(42, -0.5), (7, -1.25)])], 12, 0.1, 0.0, None)
    assert P.decode(P.encode(P.STEP_RESULT, result)) == (P.STEP_RESULT, result)
    hs = P.Handshake("m", 100, 2, 1, 64, "float32", 16, 50, 0, 512, "cpu", [2])
    assert P.decode(P.encode(P.HANDSHAKE, hs)) == (P.HANDSHAKE, hs)


def test_decode_step_costs_a_few_bytes():
    # a decode step for 32 known sequences carries only [id, 1] per sequence
    plan = P.StepPlan(100, cached_seqs=[P.CachedSequence(i, 1) for i in range(32)])
    assert len(P.encode(P.STEP_PLAN, plan)) < 200


@pytest.mark.parametrize("frame", [
    b"\xc1garbage",
    msgpack.packb([99, "plan", []]),
    msgpack.packb([P.PROTOCOL_VERSION, "launch_missiles", None]),
    msgpack.packb([P.PROTOCOL_VERSION, "plan", ["not", "a", "plan"]]),
    msgpack.packb("just a string"),
])
def test_bad_frames_raise_protocol_error(frame):
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_a_decode_step_of_a_cached_sequence_is_two_integers_on_the_wire():
    assert P.CachedSequence(5, 1).to_wire() == [5, 1]
    assert P.CachedSequence(5, 1, [9]).to_wire() == [5, 1, [9]]
    assert P.CachedSequence(5, 1, [], [], [(0, 3)]).to_wire() == [5, 1, [], [], [(0, 3)]]
    # 64 decodes of sequence ids past 1000: [id, 1] each, about 5 bytes a sequence
    plan = P.StepPlan(100, cached_seqs=[P.CachedSequence(1000 + i, 1) for i in range(64)])
    assert len(P.encode(P.STEP_PLAN, plan)) <= 340


@pytest.mark.parametrize("cached", [[5], [5, 1, [], [], [], "extra"]])
def test_a_cached_sequence_of_the_wrong_length_is_refused(cached):
    frame = msgpack.packb([P.PROTOCOL_VERSION, "plan", [1, [], [cached], [], [], [], []]])
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_handshake_carries_the_sliding_window_and_every_field_is_required():
    hs = P.Handshake("m", 100, 2, 1, 64, "float32", 16, 50, 0, 512, "cpu", [2], "tok", sliding_window=4096)
    assert P.decode(P.encode(P.HANDSHAKE, hs)) == (P.HANDSHAKE, hs)
    body = hs.to_wire()
    with pytest.raises(P.ProtocolError, match="sliding window"):
        P.Handshake.from_wire(body[:13] + [-1, 0, []])
    with pytest.raises(P.ProtocolError, match="state slots"):
        P.Handshake.from_wire(body[:14] + [-1, []])
    for wrong in (body[:15], body[:14], body + [0]):
        with pytest.raises(P.ProtocolError, match="16 fields"):
            P.Handshake.from_wire(wrong)


def test_handshake_carries_layer_groups_with_a_reach_each():
    hs = P.Handshake("m", 100, 2, 1, 64, "float32", 16, 50, 0, 512, "cpu", [2], "tok", group_reaches=[0, 128])
    assert P.decode(P.encode(P.HANDSHAKE, hs)) == (P.HANDSHAKE, hs)
    body = hs.to_wire()
    for reaches, message in (([0, -1], "must be >= 0"), ([128], "two groups or more")):
        with pytest.raises(P.ProtocolError, match=message):
            P.Handshake.from_wire(body[:15] + [reaches])
    with pytest.raises(P.ProtocolError, match="not one sliding window"):   # one or the other
        P.Handshake.from_wire(body[:13] + [128, 0, [0, 128]])


def test_logprobs_minus_one_says_none_is_used_and_lower_is_refused():
    from control_plane.sampling_params import SamplingParams
    assert SamplingParams(temperature=0.0).spec([]).logprobs == -1          # nobody reads the log-prob
    assert SamplingParams(temperature=0.0, logprobs=0).spec([]).logprobs == 0   # the chosen token's
    assert SamplingParams(temperature=0.0, logprobs=3).spec([]).logprobs == 3
    assert SamplingParams(temperature=0.8, n=1, best_of=3).spec([]).logprobs == 0   # ranked by their sum
    spec = P.SamplingSpec(temperature=0.0, logprobs=-1)
    assert P.SamplingSpec.from_wire(spec.to_wire()) == spec
    wire = spec.to_wire()
    wire[10] = -2
    with pytest.raises(P.ProtocolError, match="logprobs must be -1"):
        P.SamplingSpec.from_wire(wire)
    token = P.SampledToken(4, 9, float("nan"))
    kind, back = P.decode(P.encode(P.STEP_RESULT, P.StepResult(1, [token], 1, 0.0, 0.0)))
    assert back.sampled[0].token_id == 9 and back.sampled[0].logprob != back.sampled[0].logprob   # NaN
