import math

import pytest
import torch

from data_plane import sampler
from data_plane.sampler import SampleRow, sample
from shared.protocol import SamplingSpec


@pytest.fixture(params=["kernel", "torch"])
def route(request, monkeypatch):
    """Sampled rows drawn by the CPU kernel (the route on this machine), or by torch's operations (the route
    on other devices, and of rows the kernel turns down)."""
    if request.param == "torch":
        monkeypatch.setattr(sampler, "_kernel_draws", lambda logits, rows: {})
    return request.param


def sample_one(logits, rows):
    """First draw of every row."""
    return [draws[0] for draws in sample(logits, rows)]


def row(**kw) -> SampleRow:
    prompt = kw.pop("prompt", [1, 2, 3])
    output = kw.pop("output", [])
    return SampleRow(SamplingSpec(**kw), prompt + output, len(prompt))


def test_greedy_picks_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    out = sample_one(logits, [row(temperature=0.0, logprobs=2)])[0]
    assert out.token_id == 1
    assert math.isclose(out.logprob, float(torch.log_softmax(logits[0], -1)[1]), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs] == [1, 2]


def test_bfloat16_logits_give_the_draws_of_their_float32_copy(route):
    # plain greedy rows read bfloat16 logits as they are, the others from a float32 copy: either way the
    # draws and log-probs are those of the float32 logits
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 300, generator=gen) * 4).to(torch.bfloat16)
    for rows in ([row(temperature=0.0), row(temperature=0.0, logprobs=0)],
                 [row(temperature=0.0), row(temperature=0.0, logprobs=3)],
                 [row(temperature=0.0), row(temperature=0.0, repetition_penalty=1.3, output=[5, 7])],
                 [row(temperature=0.7, seed=11), row(temperature=0.0)]):
        got, want = sample(logits[:len(rows)].clone(), rows), sample(logits[:len(rows)].float(), rows)
        assert [[(d.token_id, d.logprob, d.top_logprobs) for d in g] for g in got] == \
            [[(d.token_id, d.logprob, d.top_logprobs) for d in w] for w in want]


def test_seeded_sampling_is_independent_of_the_batch(route):
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    alone = [sample_one(logits[2:3].clone(), [row(temperature=1.0, seed=42, output=[5] * k)])[0].token_id
             for k in range(20)]
    batched = []
    for k in range(20):
        rows = [row(temperature=1.0, seed=s, output=[5] * k) for s in (1, 2, 42, 3)]
        batched.append(sample_one(logits.clone(), rows)[2].token_id)
    assert alone == batched
    assert len(set(alone)) > 3   # it really samples, not a constant


def test_sampling_follows_the_distribution(route):
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = [0, 0, 0]
    for k in range(2000):
        counts[sample_one(logits.clone(), [row(temperature=1.0, seed=9, output=[0] * k)])[0].token_id] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.04 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_top_k_top_p_min_p_restrict_the_choices(route):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    def drawn(**kw):
        return {sample_one(logits.clone(), [row(temperature=1.0, seed=1, output=[0] * k, **kw)])[0].token_id
                for k in range(300)}
    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.75) == {0, 1}      # 0.5 + 0.3 reaches 0.75: token 2 is dropped
    assert drawn(min_p=0.5) == {0, 1}       # p >= 0.25
    assert drawn() == {0, 1, 2, 3}


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 0.0, 10.0]])
    spec = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample_one(logits.clone(), [row(output=[0], **spec)])[0].token_id != 2
    assert sample_one(logits.clone(), [row(output=[0, 0], **spec)])[0].token_id == 2


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    # frequency: token 0 generated twice loses 2 * 0.1
    assert sample_one(logits.clone(), [row(temperature=0.0, frequency_penalty=0.1, output=[0, 0])])[0].token_id == 1
    assert sample_one(logits.clone(), [row(temperature=0.0, presence_penalty=0.05, output=[0])])[0].token_id == 0
    assert sample_one(logits.clone(), [row(temperature=0.0, presence_penalty=0.2, output=[0])])[0].token_id == 1
    # repetition (HF style): positive logits of seen tokens, prompt included, are divided
    assert sample_one(logits.clone(), [row(temperature=0.0, repetition_penalty=1.2, prompt=[0])])[0].token_id == 1


def test_parallel_draws_use_one_seed_stream_per_sample(route):
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    first = sample(logits.clone(), [SampleRow(SamplingSpec(temperature=1.0, seed=5), [1], 1, num_draws=4)])[0]
    again = sample(logits.clone(), [SampleRow(SamplingSpec(temperature=1.0, seed=5), [1], 1, num_draws=4)])[0]
    assert [o.token_id for o in first] == [o.token_id for o in again]
    # draw 0 is what the request alone would draw; draw j what a request seeded with draw_seed(5, j) draws
    from shared.protocol import draw_seed
    for j, out in enumerate(first):
        alone = sample(logits.clone(), [row(temperature=1.0, seed=draw_seed(5, j))])[0][0]
        assert alone.token_id == out.token_id


def test_on_the_cpu_the_kernel_draws_every_sampled_row():
    torch.manual_seed(4)
    logits = torch.randn(3, 500)
    rows = [row(temperature=0.8, seed=1), row(temperature=0.0), row(temperature=1.2, top_p=0.9, seed=2)]
    drawn = sampler._kernel_draws(logits, rows)
    assert sorted(drawn) == [0, 2]
    out = sample(logits.clone(), rows)
    assert [out[0][0].token_id, out[2][0].token_id] == [drawn[0][0], drawn[2][0]]


def test_a_row_the_kernel_turns_down_is_drawn_by_torch():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 2.0, 1.0]])
    rows = [row(temperature=1.0, seed=3), row(temperature=1.0, seed=3)]
    assert sorted(sampler._kernel_draws(logits, rows)) == [1]
    out = sample(logits.clone(), rows)
    assert len(out) == 2 and all(0 <= draws[0].token_id < 3 for draws in out)
