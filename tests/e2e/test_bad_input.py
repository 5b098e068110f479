"""Every bad input gets HTTP 400 with an OpenAI-style error, and never disturbs other requests."""
import asyncio

import aiohttp
import pytest

from tests.e2e.client import TIMEOUT, post

pytestmark = pytest.mark.slow

BAD = [
    ("/v1/completions", None, b"{not json", "invalid_json"),
    ("/v1/completions", None, b"[1, 2]", "invalid_type"),
    ("/v1/completions", {"prompt": 42}, None, "invalid_type"),
    ("/v1/completions", {"prompt": ""}, None, "invalid_value"),
    ("/v1/completions", {"prompt": []}, None, "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, None, "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, None, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, None, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, None, "invalid_type"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, None, "invalid_token_id"),
    ("/v1/completions", {"prompt": [5] * 8200, "max_tokens": 1}, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 8150}, None, "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": "hello"}, None, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, None,
     "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokns": 5}, None, "unknown_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions_x": []}, None,
     "unknown_field"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, None, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, None, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "timeout": 0}, None, "invalid_value"),
    ("/v1/completions", None, b'{"prompt": "hi", "temperature": NaN}', "invalid_json"),
]


@pytest.mark.parametrize("path,body,raw,code", BAD)
def test_bad_input_gets_400_while_others_are_served(roomy, path, body, raw, code):
    good = {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}

    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            good_task = asyncio.create_task(post(session, roomy.url, "/v1/completions", good))
            await asyncio.sleep(0.05)   # the good request is in flight when the bad one arrives
            bad = await post(session, roomy.url, path, body, raw)
            return bad, await good_task
    (status, data, _), (good_status, good_data, _) = asyncio.run(run())
    assert status == 400, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    if body is not None and code in ("unknown_field", "unsupported_parameter"):
        (name,) = set(body) - {"prompt", "messages"}
        assert err["param"] == name and f"'{name}'" in err["message"]   # the message names the field
    assert good_status == 200 and good_data["usage"]["completion_tokens"] == 10
    assert "Paris" in good_data["choices"][0]["text"]


def test_unknown_route_and_method(roomy):
    async def run():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.get(roomy.url + "/v1/nothing") as r:
                return r.status, await r.json()
    status, data = asyncio.run(run())
    assert status == 404 and data["error"]["message"]
