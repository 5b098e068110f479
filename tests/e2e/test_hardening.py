"""No request, frame or peer takes the server down or corrupts another request (issue [10], rows
D1-D12 against real processes; D6-D8, D10, D13 are also covered in-process by
tests/unit/test_http_errors.py). One data plane and one control plane on tcp://127.0.0.1 (tiny
model, a 32-block pool), shared by the module; the last test kills the data plane."""
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import aiohttp
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol as P
from tests.e2e.client import TIMEOUT, get, post, post_many, post_one
from tests.servers import ROOT, SplitServer, free_port

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "80"))


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    server = SplitServer("hardening", tiny_model_dir, str(tmp),
                         ["--kv-cache-blocks", "32", "--max-model-len", "512"], ["--max-waiting", "100"])
    server.model = tiny_model_dir
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(split):
    """Greedy answers of the undisturbed server: every test checks the server still gives them."""
    return greedy_answers(split)


def greedy_answers(server) -> list[list[int]]:
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
              for p in PROMPTS]
    results = post_many(server.url, "/v1/completions", bodies)
    assert all(status == 200 for status, _ in results), results
    return [d["choices"][0]["token_ids"] for _, d in results]


def assert_healthy(server, reference) -> None:
    assert server.proc.poll() is None and server.dp_proc.poll() is None
    assert greedy_answers(server) == reference
    deadline = time.monotonic() + 10
    while True:
        kv = json.loads(get(server.url, "/debug/kv")[1])
        if kv["device_blocks_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kv["device_blocks_used"] == 0 and kv["integrity"] == "ok", kv


def assert_error(status, data, want_status=400, param=None):
    assert status == want_status, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err


extreme_floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                           st.sampled_from([1e-308, 5e-324, -1e-308, 1e308, -1e308, 2000.0, -2000.0, 0.0, 1e-30]))
huge_ints = st.one_of(st.integers(-2**80, 2**80), st.sampled_from([2**63, 2**63 - 1, 2**64, -2**63 - 1, 2**70]))
small = {"max_tokens": st.integers(1, 4), "n": st.integers(1, 3), "best_of": st.integers(1, 4),
         "top_k": st.integers(-1, 50), "min_tokens": st.integers(0, 2), "logprobs": st.integers(0, 5),
         "seed": st.integers(0, 2**63 - 1), "priority": st.integers(-5, 5)}
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]


def field_values(name):
    if name in small:
        return st.one_of(small[name], small[name], huge_ints)
    return st.one_of(st.floats(0.01, 2.0), extreme_floats, huge_ints)


sampling_bodies = st.fixed_dictionaries(
    {"prompt": st.sampled_from(PROMPTS), "max_tokens": st.one_of(st.integers(1, 4), huge_ints)},
    optional={**{name: field_values(name) for name in [*small, *FLOAT_FIELDS] if name != "max_tokens"},
              "use_beam_search": st.booleans(), "ignore_eos": st.booleans(),
              "stop_token_ids": st.one_of(st.lists(st.integers(0, 49151), max_size=3), st.lists(huge_ints, max_size=2),
                                          st.just(list(range(25000))))})


def test_every_sampling_field_with_extreme_values_gets_200_or_a_json_400(split, reference):
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(sampling_bodies)
    def run(body):
        status, data, _ = post_one(split.url, "/v1/completions", body)
        statuses.append(status)
        if status == 200:
            assert data["choices"] and data["usage"]["completion_tokens"] >= 1
        else:
            assert_error(status, data)
    run()
    assert {200, 400} <= set(statuses), statuses
    assert_healthy(split, reference)


def test_d1_d2_d9_numbers_that_crashed_the_engine(split, reference):
    assert_error(*post_one(split.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True,
                                                         "n": 2, "length_penalty": 2000})[:2], param="length_penalty")
    status, data, _ = post_one(split.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True,
                                                             "n": 2, "length_penalty": 10})
    assert status == 200 and len(data["choices"]) == 2
    assert_error(*post_one(split.url, "/v1/completions", {"prompt": "Hello", "stop_token_ids": [2**70]})[:2],
                 param="stop_token_ids")
    greedy = {"prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    for t in (1e-308, 1e-30):
        status, data, _ = post_one(split.url, "/v1/completions", {**greedy, "temperature": t})
        assert status == 200 and data["choices"][0]["token_ids"] == reference[0], (t, data)
    assert_healthy(split, reference)


def test_d3_a_bad_beam_beside_a_greedy_request_fails_alone(split, reference):
    beam = {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True, "n": 2, "stop_token_ids": list(range(25000))}
    greedy = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            return await asyncio.gather(post(s, split.url, "/v1/completions", greedy),
                                        post(s, split.url, "/v1/completions", beam))
    (g_status, g_data, _), (b_status, b_data, _) = asyncio.run(run())
    assert g_status == 200 and g_data["choices"][0]["token_ids"] == reference[0]
    assert_error(b_status, b_data, param="stop_token_ids")
    assert "at most 1024" in b_data["error"]["message"]   # refused before scheduling, with the limit named


def test_d8_requests_that_can_never_fit_the_pool_get_400(split, reference):
    assert_error(*post_one(split.url, "/v1/completions", {"prompt": [5] * 511, "max_tokens": 1})[:2])
    results = post_many(split.url, "/v1/completions", [{"prompt": [5] * 500, "max_tokens": 12}] * 4)
    for status, data in results:
        assert_error(status, data)
        assert data["error"]["code"] == "context_length_exceeded"


def test_d10_a_batch_past_the_queue_gets_400_naming_the_limit(split):
    status, data, headers = post_one(split.url, "/v1/completions", {"prompt": ["hi"] * 2000, "max_tokens": 1})
    assert_error(status, data, param="prompt")
    assert "--max-waiting" in data["error"]["message"] and "Retry-After" not in headers


def test_d4_hostile_frames_at_the_data_plane_are_dropped(split, reference):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(split.dp_address)
    for value in ([1, [1], None], [1, {"k": 1}, None], [1, "plan", [1] * 8], [1, "hello", [[1]]], "x", None):
        sock.send(msgpack.packb(value))
    sock.send(b"\xc1\xff garbage")
    sock.send(P.encode(P.STEP_PLAN, P.StepPlan(10**6)))   # not the owner: refused, not run
    sock.send(P.encode(P.SHUTDOWN))                       # not the owner: ignored
    assert sock.poll(5000)
    kind, message = P.decode(sock.recv())
    assert kind == P.ERROR and "owned by another control plane" in message
    sock.close(0)
    ctx.term()
    time.sleep(0.3)
    assert_healthy(split, reference)
    dp_log = split.dp_log()
    assert dp_log.count("dropped a frame") == 1 and "Traceback" not in dp_log


def test_d5_a_second_control_plane_is_refused_and_the_first_keeps_serving(split, reference):
    port = free_port()
    second = subprocess.Popen([sys.executable, "-m", "control_plane.cli", "control-plane", "--model", split.model,
                               "--port", str(port), "--data-plane", split.dp_address],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        answers = [greedy_answers(split) for _ in range(3)]   # while the second one knocks
        out, _ = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode != 0
    assert "refused" in out and "already serves another control plane" in out, out[-2000:]
    assert answers == [reference] * 3
    assert "refused a second control plane" in split.dp_log()
    assert_healthy(split, reference)


def test_d11_clients_that_vanish_are_a_quiet_abort(split, reference):
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 16}).encode()
    for i in range(30):
        stream = i % 2 == 0
        data = json.dumps({"prompt": PROMPTS[1], "max_tokens": 16, "stream": stream}).encode() if stream else body
        s = socket.create_connection(("127.0.0.1", split.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(0.002 * (i % 10))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # reset, not a clean close
        s.close()
    time.sleep(1.0)
    assert_healthy(split, reference)
    log = split.log_all()
    assert "Error handling request" not in log and "Traceback" not in log, log[-3000:]


def test_d12_health_says_503_within_a_second_of_the_data_planes_death(split):
    assert get(split.url, "/health")[0] == 200
    os.kill(split.dp_proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    while get(split.url, "/health")[0] == 200:
        assert time.monotonic() - killed < 5, "health still 200 five seconds after the data plane died"
        time.sleep(0.02)
    took = time.monotonic() - killed
    print(f"health said 503 {took * 1000:.0f} ms after the SIGKILL")
    assert took < 1.0
