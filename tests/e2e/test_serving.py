"""End to end through real HTTP against real processes serving SmolLM2-135M-Instruct in float32."""
import pytest
import torch

from tests.e2e.client import get, metric_value, post_many, post_one, sse_events, stream
from tests.helpers import TEXT_PROMPTS as PROMPTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def hf_greedy(hf, prompt_ids, max_tokens):
    model, _ = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def greedy_bodies(tok, max_tokens=MAX_TOKENS):
    return [{"prompt": tok.encode(p, add_special_tokens=False), "max_tokens": max_tokens, "temperature": 0,
             "return_token_ids": True} for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(servers, hf_smollm):
    _, tok = hf_smollm
    return [hf_greedy(hf_smollm, b["prompt"], MAX_TOKENS) for b in greedy_bodies(tok)]


def test_concurrent_greedy_equals_transformers_generate(servers, hf_smollm, expected, roomy):
    _, tok = hf_smollm
    results = post_many(roomy.url, "/v1/completions", greedy_bodies(tok))
    for (status, data), want, prompt in zip(results, expected, PROMPTS):
        assert status == 200, data
        choice = data["choices"][0]
        assert choice["token_ids"] == want, prompt
        assert choice["text"] == tok.decode(want, skip_special_tokens=True)
        assert data["usage"]["completion_tokens"] == len(want)


def test_greedy_equals_transformers_under_preemption(servers, hf_smollm, expected, tiny_pool):
    _, tok = hf_smollm
    _, before = get(tiny_pool.url, "/metrics")
    results = post_many(tiny_pool.url, "/v1/completions", greedy_bodies(tok))
    assert [d["choices"][0]["token_ids"] for _, d in results] == expected
    _, after = get(tiny_pool.url, "/metrics")
    preempted = metric_value(after, "pagedserve_num_preemptions_total") - \
        metric_value(before, "pagedserve_num_preemptions_total")
    assert preempted > 0, "a pool of 12 blocks must preempt 8 concurrent requests"
    assert metric_value(after, "pagedserve_kv_cache_usage_perc") == 0.0   # every block came back


def test_chat_answer_names_paris(roomy):
    status, data, _ = post_one(roomy.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 40, "temperature": 0})
    assert status == 200, data
    assert data["object"] == "chat.completion"
    assert "Paris" in data["choices"][0]["message"]["content"]
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]


def test_completion_stream_is_sse_ending_in_done(roomy):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    headers, lines = stream(roomy.url, "/v1/completions", body)
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(e["object"] == "text_completion" for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert events[-2]["usage"]["completion_tokens"] == 12 or chunks[-1]["choices"][0]["finish_reason"] == "stop"
    _, whole, _ = post_one(roomy.url, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat_stream_deltas(roomy):
    _, lines = stream(roomy.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0})
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["completion_tokens"] >= 1
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_prompt_forms_and_list_of_prompts(roomy, hf_smollm):
    _, tok = hf_smollm
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    status, data, _ = post_one(roomy.url, "/v1/completions", {
        "prompt": ["The capital of France is", ids, "Water boils at"], "max_tokens": 5, "temperature": 0})
    assert status == 200, data
    texts = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
    assert texts[0] == texts[1]
    assert data["usage"]["prompt_tokens"] == 2 * len(ids) + len(tok.encode("Water boils at", add_special_tokens=False))


def test_seeded_sampling_does_not_depend_on_the_batch(roomy):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    _, alone, _ = post_one(roomy.url, "/v1/completions", body)
    crowd = [body] + [{"prompt": f"Noise {i}", "max_tokens": 20, "temperature": 0.9} for i in range(5)]
    results = post_many(roomy.url, "/v1/completions", crowd)
    assert results[0][1]["choices"][0]["text"] == alone["choices"][0]["text"]
    _, other, _ = post_one(roomy.url, "/v1/completions", {**body, "seed": 99})
    assert other["choices"][0]["text"] != alone["choices"][0]["text"]


def test_stop_strings_and_stop_token_ids(roomy, hf_smollm):
    _, tok = hf_smollm
    base = {"prompt": "Count: 1, 2, 3, 4, 5,", "max_tokens": 20, "temperature": 0}
    _, free, _ = post_one(roomy.url, "/v1/completions", {**base, "return_token_ids": True})
    text, ids = free["choices"][0]["text"], free["choices"][0]["token_ids"]
    assert " 8" in text, text
    _, cut, _ = post_one(roomy.url, "/v1/completions", {**base, "stop": [" 8"]})
    assert cut["choices"][0]["text"] == text[:text.index(" 8")]
    assert cut["choices"][0]["finish_reason"] == "stop"
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])   # a token first seen at index k
    _, by_id, _ = post_one(roomy.url, "/v1/completions", {**base, "stop_token_ids": [ids[k]],
                                                          "return_token_ids": True})
    assert by_id["choices"][0]["token_ids"] == ids[:k + 1]
    assert by_id["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_and_min_tokens(roomy):
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
    _, short, _ = post_one(roomy.url, "/v1/chat/completions", {**chat, "max_tokens": 60})
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 60
    _, longer, _ = post_one(roomy.url, "/v1/chat/completions", {**chat, "max_tokens": 60, "ignore_eos": True})
    assert longer["usage"]["completion_tokens"] == 60
    _, forced, _ = post_one(roomy.url, "/v1/chat/completions", {**chat, "max_tokens": 60, "min_tokens": n + 5})
    assert forced["usage"]["completion_tokens"] >= n + 5


def test_models_health_version(roomy):
    status, text = get(roomy.url, "/v1/models")
    assert status == 200 and "SmolLM2" in text
    assert get(roomy.url, "/health")[0] == 200
    status, text = get(roomy.url, "/version")
    assert status == 200 and '"block_size": 16' in text
