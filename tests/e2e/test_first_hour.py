"""A newcomer's first hour (issue 17), against `pagedserve serve` on the default model as `make serve`
starts it: the README's question gets a sensible answer under the model's sampling defaults, the
model answers under its short id and another id gets OpenAI's 404, /health says when to come back
while the data plane restarts, and a clean shutdown leaves no ipc socket file behind."""
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.test_recovery import data_plane_pid
from tests.servers import Server

pytestmark = pytest.mark.slow


def call(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    # no --model, and the model's own sampling defaults (the test helper otherwise asks for neutral ones)
    server = Server("first-hour", ["--num-threads", "1", "--generation-config", "auto"],
                    str(tmp_path_factory.mktemp("first-hour")))
    try:
        yield server.wait_ready()
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_the_quick_start_question_gets_a_sensible_answer(default_server):
    log = default_server.log_all()
    assert "clients name the model 'SmolLM2-135M-Instruct.Q4_1' or 'SmolLM2-135M-Instruct'" in log
    assert "request defaults: temperature=0.0, from pagedserve's choice for the default model" in log
    answers = []
    for seed in range(3):   # greedy by default: the seed changes nothing
        status, _, data = call(default_server.url, "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "seed": seed, "max_tokens": 30,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert status == 200, data
        assert data["model"] == "SmolLM2-135M-Instruct.Q4_1"
        answers.append(data["choices"][0]["message"]["content"])
    assert all("Paris" in a for a in answers), answers


def test_an_unknown_model_gets_openais_404(default_server):
    status, _, data = call(default_server.url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model"
    assert call(default_server.url, "/v1/models/SmolLM2-135M-Instruct")[0] == 200
    assert call(default_server.url, "/v1/models/gpt-9")[0] == 404


def test_health_says_when_to_come_back_while_the_data_plane_restarts(default_server):
    os.kill(data_plane_pid(default_server), signal.SIGKILL)
    deadline, seen = time.monotonic() + 60, None
    while time.monotonic() < deadline and seen is None:
        status, headers, body = call(default_server.url, "/health")
        if status == 503:
            seen = (headers, body)
        time.sleep(0.05)
    assert seen is not None, "no 503 while the data plane restarted"
    headers, body = seen
    assert body["status"] == "data plane down" and int(headers["Retry-After"]) > 0
    default_server.wait_ready()


def test_a_clean_shutdown_leaves_no_ipc_socket(default_server):
    (address,) = set(re.findall(r"--listen (ipc://\S+)", default_server.log_all()))
    path = address[len("ipc://"):]
    assert os.path.exists(path)
    default_server.proc.send_signal(signal.SIGTERM)
    assert default_server.proc.wait(timeout=60) == 0
    assert not os.path.exists(path)
    default_server.stop()
