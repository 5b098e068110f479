"""The control plane's end of the ZeroMQ link: a DEALER socket. Requests are answered in the order
sent; step plans may be sent ahead of their results (the data plane queues them) and each result
is matched to its plan by step id."""
from __future__ import annotations

import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from shared import curve
from shared import protocol as P

log = logging.getLogger("pagedserve.control_plane")
POLL_SLICE_SECONDS = 0.5


class DataPlaneDead(RuntimeError):
    """The data plane did not answer in time, or answered nonsense."""


class DataPlaneClient:
    def __init__(self, address: str, curve_keys: str | None = None):
        self.address = address
        # CURVE: the link is encrypted and the data plane admits us only with the client key
        self.curve = curve.load_client_keys(curve_keys) if curve_keys else None
        self.alive_check: Callable[[], bool] | None = None   # False once the data-plane process is gone
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = None
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        if self.curve is not None:
            curve.secure_client(self.sock, self.curve)
        self.sock.connect(self.address)

    async def _request(self, kind: str, message, expect: str, timeout: float):
        await self.sock.send(P.encode(kind, message))
        return await self._receive(expect, timeout)

    async def _receive(self, expect: str, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            # wait in short slices, so that a data-plane process seen dead ends the wait at once
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.alive_check is not None and not self.alive_check()):
                self._connect()  # drop whatever the dead peer may still send late
                why = f"within {timeout:.0f}s" if remaining <= 0 else "(its process exited)"
                raise DataPlaneDead(f"no {expect} from the data plane at {self.address} {why}")
            if not await self.sock.poll(min(remaining, POLL_SLICE_SECONDS) * 1000):
                continue
            try:
                got_kind, reply = P.decode(await self.sock.recv())
            except P.ProtocolError as exc:
                log.warning("dropped a frame from the data plane: %s", exc)
                continue
            if got_kind == expect:
                return reply
            log.warning("expected %s from the data plane, got %s; dropped", expect, got_kind)

    async def handshake(self, timeout: float) -> P.Handshake:
        return await self._request(P.HELLO, None, P.HANDSHAKE, timeout)

    async def step(self, plan: P.StepPlan, timeout: float) -> P.StepResult:
        await self.send_plan(plan)
        return await self.result_of(plan.step_id, timeout)

    async def send_plan(self, plan: P.StepPlan) -> None:
        await self.sock.send(P.encode(P.STEP_PLAN, plan))

    async def result_of(self, step_id: int, timeout: float) -> P.StepResult:
        """The result of the plan `step_id`; results of earlier plans (left by a timeout) are dropped."""
        while True:
            result = await self._receive(P.STEP_RESULT, timeout)
            if result.step_id == step_id:
                return result
            log.warning("dropped the result of step %d while waiting for step %d", result.step_id, step_id)

    async def ping(self, timeout: float) -> None:
        await self._request(P.PING, None, P.PONG, timeout)

    async def shutdown(self) -> None:
        try:
            await self.sock.send(P.encode(P.SHUTDOWN), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.sock.close(0)
