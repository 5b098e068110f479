"""The control plane's end of the ZeroMQ link: a DEALER socket. Requests are answered in the order
sent; step plans may be sent ahead of their results (the data plane queues them, see
Engine.step's overlap) and each result is matched to its plan by step id.

The socket is a plain (blocking-API) ZeroMQ socket whose file descriptor the event loop watches: a
message is taken with a non-blocking receive, and a wait costs one future, not the several futures and
flag objects per message of zmq.asyncio. The control plane shares the machine's cores with the data
plane's threads, so what it spends per token is taken from them.

The link is watched two ways, so that /health follows it within a second of a death:
- a ZeroMQ socket monitor reports the disconnect of a data plane whose process ends (its
  socket closes, whatever the transport); `link_up` reads it;
- ZMTP heartbeats (answered by the peer's I/O thread even while it computes a long step)
  close the link to a peer that goes silent without closing (SIGSTOP, a lost network).

Ownership: the first handshake makes this control plane the data plane's owner and gives it a
token; every later HELLO (after a reconnect) carries it. With `tokens` (an OwnerTokens) the
token is also kept on disk, and a control plane started again begins with it (owner_tokens.py). A data plane owned by another live
control plane answers ERROR: `handshake` keeps asking for a few seconds (the other one may be
gone, and its link not yet closed) and then raises DataPlaneRefused.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from shared import curve
from shared import protocol as P

log = logging.getLogger("pagedserve.control_plane")
POLL_SLICE_SECONDS = 0.5
HEARTBEAT_IVL_MS = 1000       # ZMTP pings on the link ...
# ... and how long a silent peer has before the link is closed: generous, because a false alarm
# costs a restart of the data plane, and a loaded machine can starve its I/O thread for seconds
HEARTBEAT_TIMEOUT_MS = 10000
# a refused handshake is tried again this long: the owner may be frozen, and the data plane
# closes its link only after its own heartbeat timeout (data_plane/worker.py, also 10 s)
REFUSAL_GRACE_SECONDS = 12.0
HELLO_RETRY_SECONDS = 0.5
# a TCP connect that gets no answer (a host cut off) is given up after this and tried again, so
# that the link comes back soon after the network heals (the OS would wait minutes)
CONNECT_TIMEOUT_MS = 2000
LINK_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class DataPlaneDead(RuntimeError):
    """The data plane did not answer in time, or answered nonsense."""


class DataPlaneRefused(DataPlaneDead):
    """The data plane serves another control plane (its owner) and refused this one."""


class DataPlaneClient:
    def __init__(self, address: str, curve_keys: str | None = None, tokens=None):
        self.address = address
        self.tokens = tokens              # control_plane.owner_tokens.OwnerTokens, or None
        # CURVE: the link is encrypted and the data plane admits us only with the client key
        self.curve = curve.load_client_keys(curve_keys) if curve_keys else None
        self.alive_check: Callable[[], bool] | None = None   # False once the data-plane process is gone
        # our owner token: one a handshake gave us, or one a previous run of this control plane kept
        self.token: str | None = tokens.load(address) if tokens is not None else None
        self._link_up = False             # the monitor's view: a ZMTP session is established
        self.link_drops = 0               # disconnects seen so far
        self.ctx = zmq.Context.instance()
        self.sock = None
        self._watched = None              # (event loop, fd) whose reader is _on_fd
        self._waiters: list[asyncio.Future] = []   # woken by _on_fd when the socket may be ready
        # the monitor is read synchronously, in order, whenever the link's state matters: its events
        # precede any message of the connection they describe, so no stale event can follow a reply
        self._monitor = None
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self._stop_monitor()
            self._unwatch()
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        if self.curve is not None:
            curve.secure_client(self.sock, self.curve)
        address = f"inproc://dp-monitor-{uuid.uuid4().hex}"
        self.sock.monitor(address, LINK_EVENTS)
        self._monitor = self.ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self.sock.connect(self.address)
        self._link_up = False

    def _stop_monitor(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)

    # --- waiting on the socket in the event loop ----------------------------------------------
    def _on_fd(self) -> None:
        # ZeroMQ's descriptor signals that the socket's state may have changed (edge-triggered): each waiter
        # checks what is ready
        for waiter in self._waiters:
            _wake(waiter)

    def _watch(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching this socket's descriptor (once per socket and loop)."""
        loop = asyncio.get_running_loop()
        if self._watched is None or self._watched[0] is not loop:
            self._unwatch()
            fd = self.sock.getsockopt(zmq.FD)
            loop.add_reader(fd, self._on_fd)
            self._watched = (loop, fd)
        return loop

    def _unwatch(self) -> None:
        if self._watched is not None:
            loop, fd = self._watched
            self._watched = None
            if not loop.is_closed():
                loop.remove_reader(fd)

    async def _ready(self, event: int, seconds: float) -> bool:
        """Whether the socket can receive (event zmq.POLLIN) or send (zmq.POLLOUT) within `seconds`."""
        loop = self._watch()
        deadline = loop.time() + seconds
        while True:
            # reading EVENTS re-arms the descriptor: a change after this read signals it again
            if self.sock.getsockopt(zmq.EVENTS) & event:
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_later(remaining, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiters.remove(waiter)

    async def _send(self, frame: bytes) -> None:
        while True:
            try:
                self.sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:   # its queue is full: wait until it takes more
                await self._ready(zmq.POLLOUT, POLL_SLICE_SECONDS)

    @property
    def link_up(self) -> bool:
        """Whether a session with the data plane is established now (reads the monitor's news)."""
        while True:
            if not self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:   # (no exception raised per call)
                return self._link_up
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return self._link_up
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link_up = True
            elif self._link_up:   # a disconnect, or a failed ZMTP/CURVE handshake
                self._link_up = False
                self.link_drops += 1
                log.error("the link to the data plane at %s is down", self.address)

    async def _request(self, kind: str, message, expect: str, timeout: float, resend_on_drop: bool = False):
        if not resend_on_drop and not self.link_up and self.link_drops:
            raise DataPlaneDead(f"the link to the data plane at {self.address} is down")
        await self._send(P.encode(kind, message))
        return await self._receive(kind, message, expect, timeout, resend_on_drop)

    async def _receive(self, kind: str, message, expect: str, timeout: float, resend_on_drop: bool = False):
        """Waits for the answer `expect` to (kind, message), sent already; says it again after a link
        drop when resend_on_drop."""
        drops = self.link_drops
        deadline = time.monotonic() + timeout
        while True:
            # wait in short slices, so that a data-plane process seen dead ends the wait at once
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.alive_check is not None and not self.alive_check()):
                self._connect()  # drop whatever the dead peer may still send late
                why = f"within {timeout:.0f}s" if remaining <= 0 else "(its process exited)"
                raise DataPlaneDead(f"no {expect} from the data plane at {self.address} {why}")
            up = self.link_up   # reads the monitor's news
            if self.link_drops != drops:
                if not resend_on_drop:   # what we sent, or its answer, went down with the link
                    raise DataPlaneDead(f"the link to the data plane at {self.address} dropped")
                if up:                   # back: say it again, the first one may be lost
                    drops = self.link_drops
                    await self._send(P.encode(kind, message))
            if not await self._ready(zmq.POLLIN, min(remaining, POLL_SLICE_SECONDS)):
                continue
            try:
                got_kind, reply = P.decode(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except P.ProtocolError as exc:
                log.warning("dropped a frame from the data plane: %s", exc)
                continue
            if got_kind == expect:
                return reply
            if got_kind == P.ERROR:
                raise DataPlaneRefused(f"the data plane at {self.address} refused: {reply}")
            # a data plane checks whether its owner's link is up with a PONG; repeated HELLOs get
            # repeated HANDSHAKEs: both are expected strays
            level = logging.DEBUG if got_kind in (P.PONG, P.HANDSHAKE) else logging.WARNING
            log.log(level, "expected %s from the data plane, got %s; dropped", expect, got_kind)

    async def handshake(self, timeout: float, refusal_grace: float = REFUSAL_GRACE_SECONDS) -> P.Handshake:
        deadline = time.monotonic() + timeout
        refused_at = None
        if self.tokens is not None and self.tokens.held_elsewhere(self.address):
            refusal_grace = 0.0   # the control plane that holds its token runs on this host: it is not gone
        while True:
            try:
                hs = await self._request(P.HELLO, P.Hello(self.token), P.HANDSHAKE,
                                         max(deadline - time.monotonic(), 0.0), resend_on_drop=True)
            except DataPlaneRefused as exc:
                now = time.monotonic()
                if refused_at is None and refusal_grace > 0:
                    log.warning("%s; asking again for up to %.0fs in case its owner is gone", exc, refusal_grace)
                if refused_at is None:
                    refused_at = now
                if now - refused_at >= refusal_grace or now >= deadline:
                    raise
                await asyncio.sleep(HELLO_RETRY_SECONDS)
                continue
            self.token = hs.owner_token
            if self.tokens is not None:
                self.tokens.save(self.address, self.token)
            return hs

    async def step(self, plan: P.StepPlan, timeout: float) -> P.StepResult:
        await self.send_plan(plan)
        return await self.result_of(plan.step_id, timeout)

    async def send_plan(self, plan: P.StepPlan) -> None:
        if not self.link_up and self.link_drops:
            raise DataPlaneDead(f"the link to the data plane at {self.address} is down")
        await self._send(P.encode(P.STEP_PLAN, plan))

    async def result_of(self, step_id: int, timeout: float) -> P.StepResult:
        """The result of the plan `step_id`; results of earlier plans (left by a timeout) are dropped."""
        while True:
            result = await self._receive(P.STEP_PLAN, None, P.STEP_RESULT, timeout)
            if result.step_id == step_id:
                return result
            log.warning("dropped the result of step %d while waiting for step %d", result.step_id, step_id)

    async def ping(self, timeout: float) -> None:
        await self._request(P.PING, None, P.PONG, timeout)

    async def shutdown(self) -> None:
        try:
            self.sock.send(P.encode(P.SHUTDOWN), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self._stop_monitor()
        self._unwatch()
        self.sock.close(0)
