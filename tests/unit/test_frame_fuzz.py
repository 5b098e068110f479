"""The frame decoder survives any bytes and any msgpack value of any shape (D4): it returns a
well-typed message or raises ProtocolError, nothing else; the data plane's loop drops such a
frame, logs it once, and goes on serving its owner."""
import logging
import uuid

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_plane.worker import Worker
from shared import protocol as P
from tests.helpers import StubRunner

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=8), st.sampled_from(sorted(P.KINDS)), st.just(P.PROTOCOL_VERSION))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=14),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), inner, max_size=3)), max_leaves=40)
# frames that look almost right: the version and a real kind, with an arbitrary body
near_frames = st.tuples(st.sampled_from(sorted(P.KINDS)), values).map(lambda kb: [P.PROTOCOL_VERSION, *kb])


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True, strict_types=False)


def check(frame: bytes) -> None:
    try:
        kind, message = P.decode(frame)
    except P.ProtocolError:
        return
    assert kind in P.KINDS
    # whatever decoded re-encodes: every field has a wire type
    P.encode(kind, message)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.one_of(values, near_frames, st.lists(values, min_size=3, max_size=3)))
def test_any_msgpack_value_decodes_or_raises_protocol_error(value):
    check(pack(value))


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_protocol_error(raw):
    check(raw)


def test_the_reported_frames():
    for value in ([1, [1], None], [1, {"a": 1}, None], [[1], "plan", []], [1, "plan", [1] * 8],
                  [1, "result", [1, [[1, 2, 3, [[1, 2, 3]]]], 0, 0, 0, None]], [1, "handshake", ["m"] * 12],
                  [1, "plan", [2**64 - 1, [], [], [], [], [], [], []]], [True, "ping", None]):
        try:
            P.decode(pack(value))
        except P.ProtocolError:
            continue
        raise AssertionError(f"{value!r} decoded")


def test_a_worker_fed_fuzz_drops_each_bad_frame_logs_once_and_serves_its_owner(caplog):
    worker = Worker(StubRunner(), f"inproc://fuzz-{uuid.uuid4().hex}")
    replies = []
    worker._reply = lambda peer, kind, message=None: replies.append((peer, kind, message)) or True
    worker._owner_link_up = lambda: True   # the owner here is a name, not a socket: say it is connected
    try:
        assert worker.handle(b"owner", P.encode(P.HELLO))
        assert replies[-1][1] == P.HANDSHAKE and replies[-1][2].owner_token

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.one_of(values.map(pack), near_frames.map(pack), st.binary(max_size=64)))
        def feed(frame):
            assert worker.handle(b"attacker", frame) is True

        with caplog.at_level(logging.WARNING, logger="pagedserve.data_plane"):
            feed()
        dropped = [r for r in caplog.records if "dropped a frame" in r.getMessage()]
        assert len(dropped) == 1, [r.getMessage() for r in dropped]
        assert not any(r.exc_info for r in caplog.records)
        # nothing the attacker sent was executed or stopped the loop; the owner is still served
        assert worker.runner.plans == []
        assert worker.handle(b"owner", P.encode(P.STEP_PLAN, P.StepPlan(1)))
        assert replies[-1][:2] == (b"owner", P.STEP_RESULT) and replies[-1][2].error is None
    finally:
        worker.sock.close(0)
