"""A failure belongs to the request that caused it (D3's second half): when a step fails on the
data plane, only the culprit fails, and every other request finishes with the output it would
have had undisturbed. The real engine and model runner in-process; the fault is injected after
the runner has executed the step (so its state is half-updated, as after a real fault)."""
import asyncio

import pytest

from control_plane.sampling_params import SamplingParams
from shared.protocol import StepResult
from tests.helpers import assert_pool_clean, make_engine, run_all
from tests.runner_link import RunnerLink

POISON = 7   # a request whose prompt starts with this token makes the steps it takes part in fail


class FaultyClient(RunnerLink):
    """The in-process link that executes each plan, then reports the whole step failed if the poisoned
    request is in it and has at least `after` output tokens."""

    def __init__(self, runner, after: int):
        super().__init__(runner)
        self.after = after
        self.poisoned: set[int] = set()
        self.failures = 0

    def execute(self, plan):
        self.poisoned |= {s.seq_id for s in plan.new_seqs if s.token_ids[0] == POISON}
        result = super().execute(plan)
        for seq_id in {s.seq_id for s in plan.new_seqs} | {c.seq_id for c in plan.cached_seqs}:
            state = self.runner.seqs.get(seq_id)
            if seq_id in self.poisoned and len(state.token_ids) - state.num_prompt_tokens > self.after:
                self.failures += 1
                return StepResult(plan.step_id, error="step failed: RuntimeError: injected")
        return result


def jobs(with_poison: bool):
    greedy = [([3 + i, 9, 4, 5, 6 + i], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
              for i in range(3)]
    beams = [([5, 5, 6], SamplingParams(max_tokens=5, temperature=0.0, n=2, best_of=2, use_beam_search=True))]
    seeded = [([8, 8, 1], SamplingParams(max_tokens=6, temperature=0.9, seed=5, n=2, ignore_eos=True))]
    poison = [([POISON, 1, 2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    return greedy + beams + seeded + (poison if with_poison else [])


@pytest.fixture(scope="module")
def undisturbed():
    engine, _ = make_engine()
    return asyncio.run(run_all(engine, jobs(False)))


@pytest.mark.parametrize("overlap", [False, True], ids=["settled", "planned-ahead"])
@pytest.mark.parametrize("after", [0, 3], ids=["fails-at-once", "fails-after-3-good-steps"])
def test_only_the_culprit_fails_and_the_others_are_untouched(undisturbed, after, overlap):
    # planned ahead, the step after the failed one was sent already, with the culprit and the others in it
    engine, local = make_engine(budget=64, overlap=overlap)
    engine.client = client = FaultyClient(local.runner, after)
    outputs = asyncio.run(run_all(engine, jobs(True)))
    assert client.failures >= 1
    assert outputs[:-1] == undisturbed                 # every innocent request: the same tokens
    poison_req_outputs = outputs[-1]
    assert len(poison_req_outputs[0]) == after          # it got what it generated before its fault
    assert_pool_clean(engine)
    assert not engine.isolation.held and engine.isolation.probe is None


def test_a_culprit_arriving_beside_running_requests_is_failed_alone(undisturbed):
    engine, local = make_engine(budget=64)
    engine.client = client = FaultyClient(local.runner, 0)

    async def run():
        reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(jobs(False))]
        await engine.step()
        await engine.step()                             # the others are proven now
        prompt, params = jobs(True)[-1]
        bad = engine.add_request("bad", prompt, params)
        await engine.step()                             # the newcomer is the only suspect
        assert bad.finished and bad.end_reason == "error" and client.failures == 1
        assert not engine.isolation.held               # nobody else was held back
        while any(not r.finished for r in reqs):
            await engine.step()
        return reqs
    reqs = asyncio.run(run())
    assert all(r.end_reason in ("length", "stop") for r in reqs)
    assert_pool_clean(engine)
