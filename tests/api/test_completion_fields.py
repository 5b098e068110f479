"""Completions' echo and max_tokens 0, logit_bias and vLLM's extension fields, and log-probs with bytes,
through the openai SDK against the in-process API; the sampler's logits adjustments alone."""
import openai
import pytest
import torch

from data_plane.sampler import SampleRow, sample
from shared.protocol import SamplingSpec
from tests.inproc_server import MODEL_NAME


@pytest.fixture(scope="module")
def client(api_server):
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="unused", max_retries=0)


def greedy(client, **kw):
    return client.completions.create(model=MODEL_NAME, prompt="The sky is", temperature=0, **kw)


def test_echo_and_scoring_with_max_tokens_zero(client):
    r = greedy(client, max_tokens=3, echo=True)
    plain = greedy(client, max_tokens=3)
    assert r.choices[0].text == "The sky is" + plain.choices[0].text
    scored = greedy(client, max_tokens=0, echo=True)
    assert scored.choices[0].text == "The sky is" and scored.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].text for c in greedy(client, max_tokens=3, echo=True, stream=True))
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        greedy(client, max_tokens=0)


def test_logit_bias_allowed_token_ids_and_bad_words(client, smol_tokenizer):
    base = greedy(client, max_tokens=4, extra_body={"return_token_ids": True})
    first = base.choices[0].token_ids[0]
    banned = greedy(client, max_tokens=4, logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert banned.choices[0].token_ids[0] != first
    forced = greedy(client, max_tokens=4, logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].token_ids == [42] * 4
    allowed = greedy(client, max_tokens=6, extra_body={"allowed_token_ids": [300, 301], "return_token_ids": True})
    assert set(allowed.choices[0].token_ids) <= {300, 301}
    word = smol_tokenizer.decode([first]).strip()
    clean = greedy(client, max_tokens=4, extra_body={"bad_words": [word], "return_token_ids": True})
    assert first not in clean.choices[0].token_ids[:1]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        greedy(client, max_tokens=2, logit_bias={"99999999": 5})


def test_stop_string_kept_on_request_and_prompt_truncation(client):
    base = greedy(client, max_tokens=8).choices[0].text
    stop = base.strip()[2:4]
    assert stop
    cut = greedy(client, max_tokens=8, stop=[stop]).choices[0].text
    kept = greedy(client, max_tokens=8, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0].text
    assert kept == cut + stop and not cut.endswith(stop)
    long = client.completions.create(model=MODEL_NAME, prompt="one two three four five six", max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 2})
    assert long.usage.prompt_tokens == 2


def test_chat_logprobs_have_bytes_and_agree_with_their_top_entry(client, smol_tokenizer):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=3, temperature=0)
    for t in r.choices[0].logprobs.content:
        assert t.bytes and bytes(t.bytes).decode("utf-8", "replace")
        top = t.top_logprobs[0]
        assert top.token == t.token and top.logprob == t.logprob   # greedy: the chosen is the top one
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in r.choices[0].logprobs.content) \
        == r.choices[0].message.content


def test_sampler_adjustments_alone():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    rows = [SampleRow(SamplingSpec(temperature=0.0, logit_bias=[(7, 10.0)], logprobs=2), [1], 1),
            SampleRow(SamplingSpec(temperature=0.0, allowed_token_ids=[1, 2], bad_words_ids=[[4, 2]]), [1, 4], 1)]
    out = sample(logits.clone(), rows)
    assert out[0][0].token_id == 7 and out[0][0].logprob == out[0][0].top_logprobs[0][1]
    assert out[1][0].token_id == 1    # 2 is banned after 4 (the bad word "4 2"), 3 is not allowed
    mask = bytes([0b00100000, 0])     # token 5 only
    assert sample(logits.clone(), [SampleRow(SamplingSpec(temperature=1.0, seed=3), [1], 1, 1, mask)])[0][0].token_id == 5
