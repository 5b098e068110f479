"""The HTTP layer in-process (aiohttp on a loopback port, an engine with no data plane behind it):
every error is an OpenAI-style JSON body (D6, D7, a fault in a handler), a batch larger than the
queue gets 400 (D10), and slow clients are cut off (D13)."""
import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from control_plane import http_guard
from control_plane.api import make_app
from control_plane.http_guard import GuardedAppRunner
from tests.servers import free_port
from tests.helpers import small_engine

KEY = "secret"


class CharTokenizer:
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 90 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("".join(m["content"] for m in messages))


def serve(test, api_key=None, max_waiting=1024):
    """Runs `test(port)` against the real app and runner; no engine loop runs (nothing is generated)."""
    engine = small_engine()
    engine.tokenizer = CharTokenizer()
    engine.config.api_key = api_key
    engine.config.max_waiting = max_waiting

    async def run():
        runner = GuardedAppRunner(make_app(engine), handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await test(port)
        finally:
            await runner.cleanup()
    return asyncio.run(run())


async def raw_request(port, data: bytes) -> tuple[int, dict, bytes]:
    return await asyncio.wait_for(_raw_request(port, data), 10)


async def _raw_request(port, data: bytes) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split()[1])
    headers = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:] if ": " in line)
    body = await reader.readexactly(int(headers.get("Content-Length", 0)))
    writer.close()
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def assert_openai_error(status, headers, body, want_status, want_code=None):
    assert status == want_status, body
    assert headers["Content-Type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if want_code:
        assert err["code"] == want_code, err
    return err


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"prompt": "hi", "user": "\\udc80"}'),
])
def test_d6_lone_surrogates_get_a_json_400(path, body):
    async def test(port):
        return await raw_request(port, post(path, body))
    err = assert_openai_error(*serve(test), 400, "invalid_value")
    assert "surrogate" in err["message"]


def test_d7_an_auth_header_that_is_not_utf8_is_a_plain_401():
    async def test(port):
        body = b'{"prompt": "hi"}'
        bad = await raw_request(port, post("/v1/completions", body).replace(
            b"Content-Type", b"Authorization: Bearer secr\xff\xfet\r\nContent-Type", 1))
        latin = await raw_request(port, post("/v1/completions", body, "Authorization: Bearer s\xe9cret\r\n"))
        return bad, latin
    bad, latin = serve(test, api_key=KEY)
    assert_openai_error(*bad, 401, "invalid_api_key")
    assert_openai_error(*latin, 401, "invalid_api_key")


def test_d10_a_batch_larger_than_the_queue_gets_400_naming_the_limit():
    async def test(port):
        body = json.dumps({"prompt": ["hi"] * 2000}).encode()
        return await raw_request(port, post("/v1/completions", body))
    status, headers, body = serve(test, max_waiting=100)
    err = assert_openai_error(status, headers, body, 400, "too_many_prompts")
    assert "100" in err["message"] and "--max-waiting" in err["message"] and "Retry-After" not in headers


def test_d8_a_request_that_can_never_fit_the_pool_gets_400_at_admission():
    async def test(port):
        body = json.dumps({"prompt": [5] * 511, "max_tokens": 1}).encode()
        return await raw_request(port, post("/v1/completions", body))
    assert_openai_error(*serve(test), 400, "context_length_exceeded")


def test_a_fault_in_a_handler_is_a_json_500_not_text(monkeypatch):
    def boom(*args):
        raise RuntimeError("a bug")

    async def test(port):
        return await raw_request(port, post("/v1/completions", b'{"prompt": "hi"}'))
    monkeypatch.setattr("control_plane.engine.Engine.validate_request", boom)
    err = assert_openai_error(*serve(test), 500, "internal_error")
    assert err["type"] == "server_error" and "a bug" not in err["message"]   # no internals leak


def test_d13_slow_headers_and_slow_bodies_are_cut_off(monkeypatch):
    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT", 1.0)
    monkeypatch.setattr(http_guard, "BODY_TIMEOUT", 1.0)

    async def trickle(port, first: bytes, drip: bytes, seconds: float):
        """Sends `first`, then a byte of `drip` every 0.2 s; returns when the server closes (or what it sent)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first)
        started = time.monotonic()
        got = b""
        try:
            for i in range(int(seconds / 0.2)):
                writer.write(drip[i % len(drip):i % len(drip) + 1])
                await writer.drain()
                try:
                    got = await asyncio.wait_for(reader.read(4096), 0.2)
                    if got == b"" or got:
                        break
                except asyncio.TimeoutError:
                    continue
        except ConnectionError:
            pass
        writer.close()
        return time.monotonic() - started, got

    async def test(port):
        slow_headers = [trickle(port, b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: aaaaaaaaaaaaaa", 10)
                        for _ in range(50)]
        slow_body = trickle(port, post("/v1/completions", b'{"prompt": "hi"}' + b" " * 200)[:-200], b" ", 10)
        results = await asyncio.gather(*slow_headers, slow_body)
        # the server still answers others at once
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                assert r.status == 200
        return results
    results = serve(test)
    for seconds, got in results[:-1]:
        assert seconds < 3.0 and got == b"", (seconds, got)    # closed without an answer
    seconds, got = results[-1]
    assert seconds < 3.0 and b" 408 " in got.split(b"\r\n")[0] and b"body_timeout" in got, got


def test_d13_idle_keepalive_is_closed(monkeypatch):
    monkeypatch.setattr(http_guard, "KEEPALIVE_TIMEOUT", 1.0)

    async def test(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        started = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), 10)   # b"" once the server closes the idle connection
        writer.close()
        return head, rest, time.monotonic() - started
    first, rest, waited = serve(test)
    assert b"200" in first.split(b"\r\n")[0] and rest == b"" and waited < 3.0
