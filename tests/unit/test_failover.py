"""Replicas in-process (real engines and runners on a tiny random Llama, no sockets): a replica
whose data plane is declared dead hands its requests to the live one, where they are recomputed
and finish exactly as undisturbed, with no token streamed twice; a replica down at start serves
once it answers; the router's health and metrics follow."""
import asyncio

import pytest
from prometheus_client import generate_latest

from control_plane.dp_client import DataPlaneDead
from control_plane.engine import Engine
from control_plane.router import Router
from control_plane.sampling_params import SamplingParams
from shared.config import ControlPlaneConfig
from tests.helpers import DigitTokenizer, make_runner, paged_model
from tests.runner_link import RunnerLink

PROMPTS = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(6)]
MAX_TOKENS = 12


class FlakyClient(RunnerLink):
    """A data plane that can die (every exchange raises DataPlaneDead) and come back (its next
    handshake answers, with a new empty pool)."""

    def __init__(self, runner, die_after_steps: int | None = None):
        super().__init__(runner)
        self.die_after_steps = die_after_steps
        self.steps = 0
        self.back = asyncio.Event()

    @property
    def dead(self) -> bool:
        return self.die_after_steps is not None and self.steps >= self.die_after_steps and not self.back.is_set()

    async def step(self, plan, timeout):
        if self.dead:
            raise DataPlaneDead("stand-in data plane gone")
        self.steps += 1
        return await super().step(plan, timeout)

    async def ping(self, timeout):
        if self.dead:
            raise DataPlaneDead("stand-in data plane gone")

    async def handshake(self, timeout):
        await self.back.wait()
        self.runner.seqs.clear()   # what the real data plane does when its owner says HELLO again
        return self.runner.handshake()


def make_engine(client_of=RunnerLink, **kw):
    runner = make_runner(paged_model(seed=0), num_blocks=64, block_size=4, swap_blocks=16)
    # each plan goes through the client's step(), where the faults are injected
    config = ControlPlaneConfig(model="tiny", max_num_batched_tokens=32, max_num_seqs=16, async_scheduling=False)
    return Engine(config, client_of(runner, **kw), runner.handshake(), DigitTokenizer())


def params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def serve(router: Router, prompts, during=None):
    """Runs every prompt to its end through the router's loop; returns per request the token ids it
    streamed, in order. `during(router)` runs once every request is queued."""
    reqs = [router.add_request(f"r{i}", p, params()) for i, p in enumerate(prompts)]
    loop = asyncio.create_task(router.run())
    streamed = []
    try:
        if during is not None:
            await during(router)
        for req in reqs:
            tokens = []
            async for out in req:
                assert out.error is None, out.error
                tokens += out.token_ids
            streamed.append(tokens)
    finally:
        await router.stop()
        loop.cancel()
    return reqs, streamed


@pytest.fixture(scope="module")
def reference():
    """What every request streams with nothing disturbed."""
    _, streamed = asyncio.run(serve(Router([make_engine(), make_engine()]), PROMPTS))
    assert all(len(t) == MAX_TOKENS for t in streamed)
    return streamed


def metric(router, name):
    return router.stats.registry.get_sample_value(name, {"model_name": "tiny"})


def test_a_dead_replicas_requests_move_and_finish_as_undisturbed(reference):
    dying = make_engine(FlakyClient, die_after_steps=4)
    survivor = make_engine()
    router = Router([dying, survivor])
    reqs, streamed = asyncio.run(serve(router, PROMPTS))
    assert streamed == reference            # no token lost, none sent twice
    assert {r.replica for r in reqs} == {1}
    assert router.num_moved == 3 and metric(router, "pagedserve_requests_moved_total") == 3
    assert router.health() == {"status": "degraded", "replicas": 2, "replicas_up": 1, "replicas_down": [0]}
    assert metric(router, "pagedserve_replicas_up") == 1
    for engine in (dying, survivor):        # both pools drained, swap slots too
        report = engine.kv_report()
        assert (report["device_blocks_used"], report["cpu_blocks_used"], report["integrity"]) == (0, 0, "ok")
    assert not dying.owners and not dying.scheduler.has_work()


def test_a_replica_back_takes_the_requests_of_one_still_down_when_no_other_was_up(reference):
    """Both die; the first back takes every request, and they finish as undisturbed."""
    first = make_engine(FlakyClient, die_after_steps=3)
    second = make_engine(FlakyClient, die_after_steps=3)

    async def bring_back_one(router):
        while not (first.client.dead and second.client.dead and not router.data_plane_alive):
            await asyncio.sleep(0.01)
        assert router.health()["status"] == "degraded" and router.health()["replicas_up"] == 0
        second.client.back.set()

    router = Router([first, second])
    reqs, streamed = asyncio.run(serve(router, PROMPTS, bring_back_one))
    assert streamed == reference
    assert {r.replica for r in reqs} == {1}
    assert router.live_replicas() == [1]
    assert 'pagedserve_replicas_up{model_name="tiny"} 1.0' in generate_latest(router.stats.registry).decode()


def test_a_replica_down_at_start_joins_when_it_answers(reference):
    late = make_engine(FlakyClient, die_after_steps=0)
    late.start_unconnected()
    up = make_engine()
    router = Router([up, late])
    assert router.health()["replicas_down"] == [1]
    assert all(router.choose(p) == 0 for p in PROMPTS)   # new requests go to the replica that answers

    async def run():
        loop = asyncio.create_task(router.run())
        late.client.back.set()
        while not late.data_plane_alive:
            await asyncio.sleep(0.01)
        reqs = [router.add_request(f"r{i}", p, params()) for i, p in enumerate(PROMPTS)]
        outs = [[t async for out in r for t in out.token_ids] for r in reqs]
        await router.stop()
        loop.cancel()
        return reqs, outs
    reqs, streamed = asyncio.run(run())
    assert router.health()["status"] == "ok"
    assert {r.replica for r in reqs} == {0, 1}                # both serve now
    assert streamed == reference


def test_requests_end_at_their_deadline_while_every_replica_is_down():
    engines = [make_engine(FlakyClient, die_after_steps=2), make_engine(FlakyClient, die_after_steps=2)]
    router = Router(engines)

    async def run():
        reqs = [router.add_request(f"r{i}", p, params(), timeout=1.5) for i, p in enumerate(PROMPTS)]
        loop = asyncio.create_task(router.run())
        ends = [[out.finish_reason async for out in r if out.finished] for r in reqs]
        await router.stop()
        loop.cancel()
        return reqs, ends
    reqs, ends = asyncio.run(run())
    assert [r.end_reason for r in reqs] == ["timeout"] * len(PROMPTS)
    assert router.live_replicas() == []
    for engine in engines:
        assert engine.kv_report()["device_blocks_used"] == 0 and not engine.owners
