"""litellm against the in-process API: tools with a forced call, and the context error raised as
ContextWindowExceededError (which litellm's fallbacks key on)."""
import json

import litellm
import pytest

from tests.inproc_server import MODEL_NAME

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
    "additionalProperties": False}}}


def call(api_server, **kw):
    return litellm.completion(model="openai/" + MODEL_NAME, api_base=api_server.url + "/v1", api_key="unused",
                              num_retries=0, **kw)


def test_tools(api_server):
    r = call(api_server, messages=[{"role": "user", "content": "weather?"}], tools=[TOOL], tool_choice="required",
             max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "weather"
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Lima")


def test_context_window_error(api_server):
    with pytest.raises(litellm.ContextWindowExceededError):
        call(api_server, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
