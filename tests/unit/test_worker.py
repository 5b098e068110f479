"""The data plane's ZeroMQ loop never dies of a bad frame or a bad plan."""
import uuid

import msgpack

from data_plane.worker import Worker
from shared import protocol as P
from tests.helpers import StubRunner


def make_worker(monkeypatch):
    worker = Worker(StubRunner(), f"inproc://worker-test-{uuid.uuid4().hex}")   # inproc names outlive close()
    replies = []
    monkeypatch.setattr(worker, "_reply", lambda peer, kind, message=None: replies.append((kind, message)))
    return worker, replies


def test_hostile_frames_are_dropped_and_the_loop_goes_on(monkeypatch):
    worker, replies = make_worker(monkeypatch)
    for frame in [b"", b"\xff" * 1000, msgpack.packb([99, "plan", []]), msgpack.packb([1, "hello"]),
                  msgpack.packb([P.PROTOCOL_VERSION, "plan", {"not": "a list"}]),
                  msgpack.packb([P.PROTOCOL_VERSION, "rm -rf", None])]:
        assert worker.handle(b"peer", frame) is True
    assert replies == []
    assert worker.handle(b"peer", P.encode(P.HELLO)) is True
    assert replies[0][0] == P.HANDSHAKE and replies[0][1].model_id == "stub"
    worker.sock.close(0)


def test_a_bad_plan_gets_an_error_result_not_a_crash(monkeypatch):
    worker, replies = make_worker(monkeypatch)
    assert worker.handle(b"peer", P.encode(P.HELLO))   # the owner: its plans are executed
    assert worker.handle(b"peer", P.encode(P.STEP_PLAN, P.StepPlan(3, cached_seqs=[P.CachedSequence(5, 1)])))
    kind, result = replies[-1]
    assert kind == P.STEP_RESULT and result.step_id == 3 and "unknown sequence" in result.error
    assert worker.handle(b"peer", P.encode(P.STEP_PLAN, P.StepPlan(4)))
    assert replies[-1][1].error is None
    def fault(plan):   # a fault inside the step
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(worker.runner, "execute", fault)
    assert worker.handle(b"peer", P.encode(P.STEP_PLAN, P.StepPlan(5, new_seqs=[
        P.NewSequence(1, [1, 2, 3], 3, 0, 3, [0], P.SamplingSpec())])))
    assert replies[-1][1].step_id == 5 and "ZeroDivisionError" in replies[-1][1].error
    # a plan of the wrong types never reaches the runner: the decoder drops it
    typed_wrong = P.NewSequence(1, "abc", 3, 0, 3, [0], P.SamplingSpec())
    num_replies = len(replies)
    assert worker.handle(b"peer", P.encode(P.STEP_PLAN, P.StepPlan(6, new_seqs=[typed_wrong])))
    assert len(replies) == num_replies
    assert worker.handle(b"peer", P.encode(P.SHUTDOWN)) is False
    worker.sock.close(0)
