"""Structured output (xgrammar matchers in the control plane, bitmasks applied by the sampler) and tool
calls, through the openai SDK against the in-process API on a random model: only the grammar can
make its output valid, so valid output shows the masks took effect."""
import json

import openai
import pytest

from tests.inproc_server import MODEL_NAME

USER = [{"role": "user", "content": "give me data"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_response_format_with_parallel_samples(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60, n=3, seed=1,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "w", "schema": SCHEMA, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert set(value) == {"city", "days"} and isinstance(value["days"], int)


def test_regex_and_choice_on_completions(client):
    r = client.completions.create(model=MODEL_NAME, prompt="code:", max_tokens=10,
                                  extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert r.choices[0].text[:3].isupper() and r.choices[0].text[3] == "-" and len(r.choices[0].text) == 6
    r = client.completions.create(model=MODEL_NAME, prompt="pick:", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"guided_regex": "(["})


def test_named_and_required_tool_choice_force_a_call(client):
    for choice in ({"type": "function", "function": {"name": "weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60, tools=[WEATHER],
                                           tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        assert call.function.name == "weather" and set(json.loads(call.function.arguments)) == {"city", "days"}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60, tools=[WEATHER],
                                                 tool_choice="required", stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "weather" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_parses_hermes_blocks():
    from control_plane.tools import ToolMode, parse_output
    mode = ToolMode(({"name": "weather", "parameters": {}},), "auto")
    content, calls = parse_output(mode, 'ok <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content == "ok" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_output(mode, "plain text") == ("plain text", [])
