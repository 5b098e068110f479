"""Scoring a prompt through the API: completions' echo with logprobs (legacy lists, first token null),
max_tokens 0, vLLM's prompt_logprobs, streamed and not, against transformers' log_softmax of the same
model; and the 400s of the inputs that make no sense."""
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from tests.helpers import tiny_llama
from tests.inproc_server import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(api_server, smol_tokenizer):
    """(prompt ids, per token 1.. its log-prob, rank, and the 3 best (id, log-prob)) from transformers'
    own forward of the server's weights."""
    ref = tiny_llama(attn="eager", seed=0, vocab_size=len(smol_tokenizer), hidden=64, max_pos=512)
    ref.load_state_dict(api_server.runner.model.state_dict())
    ids = smol_tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        rows = torch.log_softmax(ref(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    values, top = torch.topk(rows, 3, dim=-1)
    return ids, chosen.tolist(), ((rows > chosen[:, None]).sum(1) + 1).tolist(), \
        [list(zip(i, v)) for i, v in zip(top.tolist(), values.tolist())]


def post(server, body, path="/v1/completions"):
    req = urllib.request.Request(server.url + path, json.dumps({"model": MODEL_NAME, **body}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def close(a, b):
    return all(abs(x - y) <= 1e-5 for x, y in zip(a, b, strict=True))


def test_echo_logprobs_with_max_tokens_zero_score_the_prompt(client, expected, smol_tokenizer):
    ids, logprobs, _, top = expected
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [smol_tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert close(lp.token_logprobs[1:], logprobs)
    for i, entry in enumerate(lp.top_logprobs[1:]):
        best = {smol_tokenizer.decode([t]): v for t, v in top[i]}
        assert set(entry) == set(best) | {lp.tokens[i + 1]}   # the 3 best and the prompt token itself
        assert all(abs(entry[t] - v) <= 1e-5 for t, v in best.items())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_logprobs_then_the_generated_tokens(client, expected):
    ids, logprobs, _, _ = expected
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    assert len(lp.tokens) == len(ids) + 3 and close(lp.token_logprobs[1:len(ids)], logprobs)
    assert lp.tokens[len(ids):] == plain.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(PROMPT)
    # streamed: the prompt's chunk (with its log-probs) comes first, then the tokens
    chunks = [c.choices[0] for c in client.completions.create(echo=True, stream=True, **kw)]
    assert "".join(c.text for c in chunks) == echoed.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_streamed_scoring_sends_the_prompt_and_no_token(client, expected):
    ids, logprobs, _, _ = expected
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0,
                                                               echo=True, logprobs=0, stream=True)]
    assert "".join(c.text for c in chunks) == PROMPT and chunks[-1].finish_reason == "length"
    assert close([v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs][1:], logprobs)
    # without log-probs too: server-sent events, the prompt, and no token
    events = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == PROMPT
    assert events[-1].usage.completion_tokens == 0


def test_vllm_prompt_logprobs_shape_and_values(api_server, expected, smol_tokenizer):
    ids, logprobs, ranks, top = expected
    # the raw model distribution: temperature and logit_bias change the sampling, not these numbers
    for extra in ({}, {"temperature": 1.7, "logit_bias": {str(ids[1]): 50}}):
        status, text = post(api_server, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3, **extra})
        assert status == 200, text
        got = json.loads(text)["choices"][0]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for i, entry in enumerate(got[1:]):
            token = entry[str(ids[i + 1])]
            assert abs(token["logprob"] - logprobs[i]) <= 1e-5 and token["rank"] == ranks[i]
            assert token["decoded_token"] == smol_tokenizer.decode([ids[i + 1]])
            for rank, (alt, value) in enumerate(top[i], start=1):
                assert abs(entry[str(alt)]["logprob"] - value) <= 1e-5 and entry[str(alt)]["rank"] == rank
            assert len(entry) == 3 + (ranks[i] > 3)


def test_prompt_logprobs_alone_with_max_tokens_zero_and_on_chat(api_server, expected):
    ids, logprobs, _, _ = expected
    status, text = post(api_server, {"prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 0, "stream": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    got = events[0]["choices"][0]["prompt_logprobs"]
    assert close([e[str(t)]["logprob"] for e, t in zip(got[1:], ids[1:])], logprobs)
    assert "".join(e["choices"][0]["text"] for e in events) == ""
    status, text = post(api_server, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
                                     "prompt_logprobs": 1}, "/v1/chat/completions")
    assert status == 200, text
    body = json.loads(text)
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "use_beam_search": True, "n": 2, "temperature": 0}, "use_beam_search"),
    ({"echo": True, "logprobs": 2, "use_beam_search": True, "n": 2, "temperature": 0}, "use_beam_search"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 2}, "max_tokens"),
])
def test_bad_scoring_requests_get_400(api_server, body, param):
    status, text = post(api_server, {"prompt": PROMPT, "max_tokens": 2, **body})
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == param


def test_streamed_chat_refuses_prompt_logprobs(api_server):
    status, text = post(api_server, {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                                     "stream": True}, "/v1/chat/completions")
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt_logprobs"
