"""The engine's loop on the real model runner in-process (no sockets), on a tiny random Llama:
recovery renews what depends on the data plane's handshake."""
import asyncio
from dataclasses import replace

from control_plane.engine import Engine
from control_plane.preemption import PreemptionPolicy
from control_plane.sampling_params import SamplingParams
from shared.config import ControlPlaneConfig
from tests.helpers import DigitTokenizer, make_runner, paged_model


class InProcessClient:
    """Stands in for the ZeroMQ client: the runner executes plans in the order they were sent, as
    the data plane's loop does, when their result is asked for."""
    def __init__(self, runner):
        self.runner = runner
        self.sent = []          # plans sent and not yet executed
        self.plans = []         # every plan, in order

    async def send_plan(self, plan):
        self.sent.append(plan)
        self.plans.append(plan)

    async def result_of(self, step_id, timeout):
        while True:
            result = self.runner.execute(self.sent.pop(0))
            if result.step_id == step_id:
                return result

    async def step(self, plan, timeout):
        await self.send_plan(plan)
        return await self.result_of(plan.step_id, timeout)

    async def ping(self, timeout):
        return None


def make_engine(num_blocks=64, block_size=4, budget=32, max_num_seqs=128, mode="auto", **cp):
    runner = make_runner(paged_model(seed=0), num_blocks=num_blocks, block_size=block_size, swap_blocks=64)
    config = ControlPlaneConfig(model="tiny", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                preemption_mode=mode, **cp)
    return Engine(config, InProcessClient(runner), runner.handshake(), DigitTokenizer())


def test_after_a_restart_the_watermark_and_block_bytes_follow_the_new_data_plane():
    engine = make_engine(num_blocks=64)
    req = engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0))
    asyncio.run(engine.step())
    old_bytes = engine.policy.block_bytes
    # the restarted data plane has a larger pool and half-size KV (bfloat16)
    engine.hs = replace(engine.hs, num_device_blocks=2000, dtype="bfloat16")
    engine._requeue_all()
    assert engine.scheduler.watermark_blocks == 20
    assert engine.policy.block_bytes == PreemptionPolicy.block_bytes_of(engine.hs) == old_bytes // 2
    assert engine.scheduler.waiting[0].seq_id == next(iter(req.seqs))
