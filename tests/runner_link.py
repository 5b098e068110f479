"""The one in-process data plane of the tests and benchmarks, `RunnerLink`: what the engine's ZeroMQ
client is (control_plane.serving.DataPlaneLink), over a runner in the same process. The runners behind
it: the ModelRunner (tests/helpers.py's make_runner), bench/_fake_engine.py's FakeRunner (the data
plane's bookkeeping without a model), and `Unreachable`. No torch here: the control-plane benchmarks
import it without loading a model."""
from __future__ import annotations


class RunnerLink:
    """The one in-process data plane of the tests and benchmarks: a `control_plane.serving.DataPlaneLink`
    over anything that executes plans as the data plane's loop does (`execute(plan) -> StepResult` and
    `handshake()`): the ModelRunner, bench/_fake_engine.py's FakeRunner (no model), or `Unreachable`.
    Plans run in the order they were sent, when a result is asked for (with overlap, the server's
    default, the engine sends one plan ahead)."""
    address = "in-process"
    link_up = True   # in-process: no link to lose (what Engine.data_plane_alive reads of a client)

    def __init__(self, runner):
        self.runner = runner
        self.sent = []          # plans sent and not yet executed
        self.plans = []         # every plan, in order
        self.sent_ahead = 0     # plans sent while an earlier one was not executed yet

    async def handshake(self, timeout):
        return self.runner.handshake()

    async def send_plan(self, plan):
        self.sent_ahead += bool(self.sent)
        self.sent.append(plan)
        self.plans.append(plan)

    async def result_of(self, step_id, timeout):
        while True:
            result = self.execute(self.sent.pop(0))
            if result.step_id == step_id:
                return result

    def execute(self, plan):
        """One plan on the runner, when its result (or a later one's) is asked for."""
        return self.runner.execute(plan)

    async def step(self, plan, timeout):
        await self.send_plan(plan)
        return await self.result_of(plan.step_id, timeout)

    async def ping(self, timeout):
        return None


class Unreachable:
    """A data plane that must never be reached: for admission and HTTP checks."""

    def __init__(self, hs):
        self.hs = hs

    def handshake(self):
        return self.hs

    def execute(self, plan):
        raise AssertionError("nothing may reach the data plane")
