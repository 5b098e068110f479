"""The openai SDK against the API served in this process (tests/inproc_server.py): message shapes,
stream usage, nulls, model endpoints, tokenizing, request ids and OpenAI's context-length error."""
import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.inproc_server import MODEL_NAME

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="unused", max_retries=0)


def http(url, path, body=None, headers=None, method=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_content_parts_developer_role_and_names(client):
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0, messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]}])
    same = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.prompt_tokens == same.usage.prompt_tokens and r.system_fingerprint.startswith("fp_")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "'image_url'" in info.value.message and info.value.code == "unsupported_content_part"


def test_the_plain_streaming_loop_sees_a_choice_in_every_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, stream=True))
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and text
    plain = list(client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, stream=True,
                                           stream_options={"include_usage": False}))
    assert all(len(c.choices) == 1 for c in plain)


def test_usage_chunk_when_asked_and_continuous_usage(client, api_server):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    raw = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, stream=True,
                                         extra_body={"stream_options": {"continuous_usage_stats": True}})
    # every chunk with a choice carries the usage so far; the last token's chunk may have no content (a
    # sampled token whose text is an unfinished character sends an empty delta), so content is not the filter
    counts = [c.usage.completion_tokens for c in raw if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] == 0   # the role chunk comes first


def test_null_means_absent(client, api_server):
    status, _, body = http(api_server.url, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": USER, "max_tokens": None, "temperature": None, "stop": None,
        "n": None, "seed": None, "top_p": None, "logprobs": None, "response_format": None, "tools": None,
        "stream_options": None, "max_completion_tokens": None, "tool_choice": None, "logit_bias": None})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_models_retrieve_and_created(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL_NAME] and listed[0].created > 1_700_000_000
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert "'gpt-9'" in info.value.message


def test_unknown_route_is_an_openai_404_naming_it(api_server):
    status, headers, body = http(api_server.url, "/v1/embeddingz", {"input": "x"})
    assert status == 404 and "POST /v1/embeddingz" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_request_id_is_echoed_or_made(api_server):
    _, headers, _ = http(api_server.url, "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert headers["X-Request-Id"] == "trace-42"
    _, headers, _ = http(api_server.url, "/v1/nowhere")
    assert len(headers["X-Request-Id"]) == 32
    raw = urllib.request.Request(api_server.url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json", "X-Request-Id": "stream-7"},
        data=json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}).encode())
    with urllib.request.urlopen(raw, timeout=60) as r:
        assert r.headers["X-Request-Id"] == "stream-7" and r.read().endswith(b"data: [DONE]\n\n")


def test_tokenize_and_detokenize(api_server, smol_tokenizer):
    status, _, body = http(api_server.url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and body["tokens"] == smol_tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512 and body["token_strs"]
    status, _, chat = http(api_server.url, "/tokenize", {"messages": USER})
    assert chat["tokens"] == list(smol_tokenizer.apply_chat_template(USER, add_generation_prompt=True,
                                                                     tokenize=True)["input_ids"])
    status, _, back = http(api_server.url, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "Hello world"
    status, _, err = http(api_server.url, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["code"] == "invalid_token_id"


def test_context_length_error_is_worded_as_openai_words_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1000)
    err = info.value
    assert err.code == "context_length_exceeded"
    assert "This model's maximum context length is 512 tokens. However, you requested" in err.message
    assert "in the messages, 1000 in the completion" in err.message
