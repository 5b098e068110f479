"""Prompt log-probs at the runner: the real scheduler and runner, in-process, against transformers' own
log_softmax of the same model's logits; chunked prefill, batching and the prefix cache; the wire."""
from types import SimpleNamespace

import pytest
import torch

from control_plane import prompt_scoring
from control_plane.block_manager import BlockManager
from control_plane.sampling_params import SamplingParams
from control_plane.scheduler import Finish, Scheduler
from control_plane.sequence import Sequence
from shared import protocol as P
from tests.helpers import make_runner, paged_model, tiny_llama

PROMPTS = [[1] + list(range(40, 77)), [1, 300, 5, 301, 9, 302, 7, 303, 11, 12, 13]]
K = 4


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(attn="eager", seed=0)


@pytest.fixture(scope="module")
def runner():
    return make_runner(paged_model(seed=0), num_blocks=64, block_size=4)


def hf_scores(model, prompt):
    """transformers' forward of the whole prompt: per token 1.., (logprob, rank, top-K ids, top-K values)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    rows, targets = logprobs[:-1], torch.tensor(prompt[1:])
    chosen = rows.gather(1, targets[:, None])
    ranks = (rows > chosen).sum(1) + 1
    values, ids = torch.topk(rows, K, dim=-1)
    return chosen[:, 0].tolist(), ranks.tolist(), ids.tolist(), values.tolist()


def score(runner, prompts, budget, bm=None, k=K, ask=None):
    """Plays the control plane until every prompt has sampled one token; returns each prompt's
    recorded (logprob, rank, top) per position and the block manager. `ask`: which prompts ask."""
    bm = bm or BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True,
                            group_reaches=runner.handshake().group_reaches)
    sched = Scheduler(bm, 8, budget)
    owners, seqs = {}, []
    for i, prompt in enumerate(prompts):
        wants = ask is None or ask[i]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k if wants else None)
        seq = Sequence(f"r{i}", list(prompt), len(prompt), params, params.spec([]), arrival_time=float(i))
        owners[seq.seq_id] = SimpleNamespace(prompt_logprobs=[None] * len(prompt) if wants else None)
        seqs.append(seq)
        sched.add(seq)
    while sched.has_work():
        plan = sched.schedule()
        result = P.decode(P.encode(P.STEP_RESULT, runner.execute(plan)))[1]   # through the wire
        assert result.error is None
        sched.update(plan, result)
        prompt_scoring.record(owners, result.prompt_logprobs)
        ended = []
        for tok in result.sampled:
            seq = next(s for s in seqs if s.seq_id == tok.seq_id)
            seq.token_ids.append(tok.token_id)
            ended.append(Finish(seq, "length"))
        sched.apply(ended)
    sched.check_integrity()
    return [owners[s.seq_id].prompt_logprobs for s in seqs], bm


def assert_matches(recorded, expected):
    logprobs, ranks, top_ids, top_values = expected
    assert recorded[0] is None and all(r is not None for r in recorded[1:])
    got = torch.tensor([r[0] for r in recorded[1:]])
    assert torch.allclose(got, torch.tensor(logprobs), atol=1e-5, rtol=0), (got - torch.tensor(logprobs)).abs().max()
    assert [r[1] for r in recorded[1:]] == ranks
    assert [[i for i, _ in r[2]] for r in recorded[1:]] == top_ids
    got_top = torch.tensor([[v for _, v in r[2]] for r in recorded[1:]])
    assert torch.allclose(got_top, torch.tensor(top_values), atol=1e-5, rtol=0)


def test_one_shot_prompt_logprobs_equal_transformers(runner, reference):
    recorded, _ = score(runner, PROMPTS, budget=256)
    for prompt, rec in zip(PROMPTS, recorded):
        assert_matches(rec, hf_scores(reference, prompt))


@pytest.mark.parametrize("budget", [3, 7])
def test_chunked_prefill_gives_the_one_shot_numbers(runner, reference, budget):
    # the 38-token prompt takes many chunks, which end inside blocks and share steps with the other prompt
    recorded, _ = score(runner, PROMPTS, budget=budget)
    for prompt, rec in zip(PROMPTS, recorded):
        assert_matches(rec, hf_scores(reference, prompt))


def test_k_zero_gives_the_tokens_alone(runner, reference):
    (rec,), _ = score(runner, PROMPTS[1:], budget=256, k=0)
    logprobs, ranks, _, _ = hf_scores(reference, PROMPTS[1])
    assert [r[2] for r in rec[1:]] == [[]] * (len(PROMPTS[1]) - 1)
    assert torch.allclose(torch.tensor([r[0] for r in rec[1:]]), torch.tensor(logprobs), atol=1e-5, rtol=0)
    assert [r[1] for r in rec[1:]] == ranks


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(runner, reference):
    prompt = PROMPTS[0]
    _, bm = score(runner, [prompt], budget=256, ask=[False])     # fills the prefix cache
    hits = bm.prefix_hits
    (rec,), bm = score(runner, [prompt], budget=256, bm=bm)
    assert bm.prefix_hits == hits, "a sequence that asks for prompt log-probs took a prefix hit"
    assert_matches(rec, hf_scores(reference, prompt))
    score(runner, [prompt], budget=256, bm=bm, ask=[False])        # without prompt log-probs it does hit
    assert bm.prefix_hits > hits


def test_wire_fields_are_optional_and_checked():
    spec = P.SamplingSpec(prompt_logprobs=0)
    assert P.SamplingSpec.from_wire(spec.to_wire()) == spec and len(spec.to_wire()) == 17
    assert len(P.SamplingSpec().to_wire()) == 13 and P.SamplingSpec.from_wire(P.SamplingSpec().to_wire()).prompt_logprobs is None
    with pytest.raises(P.ProtocolError):
        P.SamplingSpec.from_wire(P.SamplingSpec(prompt_logprobs=-1).to_wire())
    scores = P.PromptLogprobs(4, 1, [-0.5, -2.0], [1, 7], [[(3, -0.5)], [(9, -0.25)]])
    result = P.StepResult(2, [], 5, prompt_logprobs=[scores])
    assert P.decode(P.encode(P.STEP_RESULT, result)) == (P.STEP_RESULT, result)
    assert len(P.StepResult(2).to_wire()) == 6   # an old control plane's result shape while nobody asks
    for bad in ([4, 0, [-0.5], [1], []], [4, 1, [-0.5, -1.0], [1], []], [4, 1, [-0.5], [1], [[], []]]):
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.STEP_RESULT, [2, [], 5, 0.0, 0.0, None, [bad]]))


def test_engine_keeps_exact_prompt_logprobs_under_preemption_and_restart(reference):
    # 14 blocks of 4 tokens cannot hold 5 sequences of 11 + 12 tokens: they preempt (recompute) each other,
    # and the 8-token budget splits prompts into chunks; a data-plane restart at step 3 re-queues
    # everything, and the preemptions go on after it
    restart_at = 3
    import asyncio

    from tests.helpers import make_engine
    engine, _ = make_engine(num_blocks=14, block_size=4, budget=8, mode="recompute")
    prompts = [[1] + [100 + 7 * i + j for j in range(10)] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]

    async def run():
        step = 0
        while any(not r.finished for r in reqs):
            await engine.step()
            step += 1
            if step == restart_at:
                engine._requeue_all()
    asyncio.run(run())
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force recompute preemptions"
    for prompt, req in zip(prompts, reqs):
        assert req.end_reason == "length"
        assert_matches(req.prompt_logprobs, hf_scores(reference, prompt))


@pytest.mark.parametrize("name", ["Gemma2 (caps, alternating window)", "Granite (logits_scaling)"])
def test_the_models_own_logits_path_soft_cap_and_scaling(name):
    # Gemma 2 caps its final logits at 3.0 and Granite divides them by 4: an lm_head-only path differs a lot
    from data_plane import attention
    from tests.architectures import SUPPORTED, build
    model = build(SUPPORTED[name], "eager")
    prompt = [1] + list(range(30, 59))
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    model.set_attn_implementation(attention.register())
    (rec,), _ = score(make_runner(model, num_blocks=32, block_size=4), [prompt], budget=8)
    got = torch.tensor([r[0] for r in rec[1:]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
