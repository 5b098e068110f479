"""The named interfaces between the control plane's parts: what the API asks of the engine it serves
(one `Engine`, or a `Router` over several replicas: both implement `ServingEngine`), and what an engine
asks of its link to a data plane (`dp_client.DataPlaneClient` over ZeroMQ; in tests, an in-process
runner: tests/runner_link.py's RunnerLink)."""
from __future__ import annotations

from typing import Protocol

from control_plane.request import Request
from control_plane.sampling_params import SamplingParams
from shared.config import ControlPlaneConfig
from shared.protocol import Handshake, StepPlan, StepResult


class ServingEngine(Protocol):
    config: ControlPlaneConfig
    tokenizer: object
    stats: object                  # its Prometheus registry: stats.registry
    draining: bool                 # a graceful shutdown: new requests are refused

    @property
    def hs(self) -> Handshake: ...             # the (first) data plane's handshake: vocabulary, lengths

    @property
    def data_plane_alive(self) -> bool: ...    # some data plane answers

    @property
    def pool_capacity_tokens(self) -> int: ...

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              timeout: float | None = None) -> Request: ...

    def abort(self, req: Request, reason: str = "abort", error: str | None = None) -> None: ...

    def num_waiting(self) -> int: ...

    def num_unfinished(self) -> int: ...

    def health(self) -> dict: ...              # /health's body while it serves

    def kv_report(self) -> dict: ...           # /debug/kv

    def refresh_gauges(self) -> None: ...      # before /metrics is read


class DataPlaneLink(Protocol):
    address: str

    @property
    def link_up(self) -> bool: ...             # the link itself (not the data plane's answers)

    async def handshake(self, timeout: float) -> Handshake: ...

    async def step(self, plan: StepPlan, timeout: float) -> StepResult: ...

    async def send_plan(self, plan: StepPlan) -> None: ...          # overlap (the default): send now,

    async def result_of(self, step_id: int, timeout: float) -> StepResult: ...   # the result later

    async def ping(self, timeout: float) -> None: ...
