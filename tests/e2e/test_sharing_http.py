"""Memory sharing through HTTP on the real SmolLM2: beams equal transformers', seeded parallel
samples are reproducible, and prefix-cache hits show in /metrics."""
import pytest
import torch

from tests.e2e.client import get, metric_value, post_many, post_one

pytestmark = pytest.mark.slow

BEAM_PROMPTS = ["The capital of France is", "My favourite fruit is", "def add(a, b):"]


def hf_beams(hf, prompt_ids, width, n, max_tokens):
    model, tok = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=n,
                             max_new_tokens=max_tokens, do_sample=False)
    rows = []
    for row in out[:, len(prompt_ids):].tolist():
        eos = tok.eos_token_id
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(servers, hf_smollm, roomy, width):
    _, tok = hf_smollm
    prompts = [tok.encode(p, add_special_tokens=False) for p in BEAM_PROMPTS]
    bodies = [{"prompt": p, "max_tokens": 12, "use_beam_search": True, "best_of": width, "n": 2,
               "temperature": 0, "return_token_ids": True} for p in prompts]
    results = post_many(roomy.url, "/v1/completions", bodies)
    for (status, data), prompt in zip(results, prompts):
        assert status == 200, data
        got = [c["token_ids"] for c in sorted(data["choices"], key=lambda c: c["index"])]
        assert got == hf_beams(hf_smollm, prompt, width, 2, 12), tok.decode(prompt)


def test_seeded_parallel_samples_are_reproducible(roomy):
    body = {"prompt": "Write a name for a cat:", "max_tokens": 10, "n": 4, "temperature": 1.0, "seed": 2024}
    texts = []
    for _ in range(2):
        status, data, _ = post_one(roomy.url, "/v1/completions", body)
        assert status == 200 and len(data["choices"]) == 4
        texts.append([c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])])
        assert data["usage"]["prompt_tokens"] < data["usage"]["completion_tokens"]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1


def test_prefix_cache_hits_show_in_metrics(roomy):
    system = "You are a careful assistant who answers in one short sentence. " * 8
    _, before = get(roomy.url, "/metrics")
    status, first, _ = post_one(roomy.url, "/v1/completions", {"prompt": system + "Name a colour.", "max_tokens": 4,
                                                               "temperature": 0})
    assert status == 200
    _, middle = get(roomy.url, "/metrics")
    status, second, _ = post_one(roomy.url, "/v1/completions", {"prompt": system + "Name a fruit.", "max_tokens": 4,
                                                                "temperature": 0})
    assert status == 200
    _, after = get(roomy.url, "/metrics")
    hits = metric_value(after, "pagedserve_prefix_cache_hits_total") - \
        metric_value(middle, "pagedserve_prefix_cache_hits_total")
    queries = metric_value(after, "pagedserve_prefix_cache_queries_total") - \
        metric_value(middle, "pagedserve_prefix_cache_queries_total")
    shared_blocks = (first["usage"]["prompt_tokens"] - 8) // 16
    assert queries == second["usage"]["prompt_tokens"]
    assert hits >= 16 * (shared_blocks - 1) and hits > 0
    assert metric_value(middle, "pagedserve_prefix_cache_queries_total") > \
        metric_value(before, "pagedserve_prefix_cache_queries_total")
