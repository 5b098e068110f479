"""The data plane's ZeroMQ loop: answers the handshake, executes plans, answers pings.

A ROUTER socket bound at the listen address; one control plane talks to it through a DEALER.
Frames that do not decode are logged and dropped: they never stop the loop.
"""
from __future__ import annotations

import logging
import time

import zmq

from data_plane.model_runner import ModelRunner, PlanError
from shared import curve
from shared import protocol as P

log = logging.getLogger("pagedserve.data_plane")


class Worker:
    def __init__(self, runner: ModelRunner, listen: str, stats=None, curve_keys: str | None = None):
        self.runner = runner
        self.stats = stats   # data_plane.metrics.DataPlaneStats, or None
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.auth = None     # the ZAP handler that admits only the authorized control plane (CURVE)
        if curve_keys:
            self.auth = curve.secure_server(self.ctx, self.sock, curve.load_server_keys(curve_keys))
            log.info("CURVE on: only the control plane holding the client key of %s is admitted", curve_keys)
        self.sock.bind(listen)
        self.listen = listen
        self.steps = 0

    def _reply(self, peer: bytes, kind: str, message=None) -> None:
        self.sock.send_multipart([peer, P.encode(kind, message)])

    def handle(self, peer: bytes, frame: bytes) -> bool:
        """Handles one frame; returns False when told to shut down."""
        try:
            kind, message = P.decode(frame)
        except P.ProtocolError as exc:
            log.warning("dropped a frame: %s", exc)
            return True
        if kind == P.HELLO:
            self._reply(peer, P.HANDSHAKE, self.runner.handshake())
        elif kind == P.PING:
            self._reply(peer, P.PONG)
        elif kind == P.STEP_PLAN:
            started = time.perf_counter()
            try:
                result = self.runner.execute(message)
            except PlanError as exc:
                log.error("refused plan %d: %s", message.step_id, exc)
                result = P.StepResult(message.step_id, error=f"bad plan: {exc}")
            except Exception as exc:   # a malformed field, or a fault in the step: answer, never die
                log.exception("step %d failed", message.step_id)
                result = P.StepResult(message.step_id, error=f"step failed: {type(exc).__name__}: {exc}")
            self.steps += 1
            seconds = time.perf_counter() - started
            self._reply(peer, P.STEP_RESULT, result)
            if self.stats is not None:
                self.stats.on_step(message, result, seconds)
        elif kind == P.SHUTDOWN:
            log.info("shutdown requested by the control plane")
            return False
        else:
            log.warning("ignored a %s frame", kind)
        return True

    # A subclass that must act when no message comes for a while sets these (rank 0 of a
    # tensor-parallel group sends its followers a heartbeat).
    idle_seconds: float | None = None

    def on_idle(self) -> None:
        pass

    def serve_forever(self) -> None:
        log.info("data plane listening on %s", self.listen)
        try:
            while True:
                if self.idle_seconds is not None and not self.sock.poll(self.idle_seconds * 1000, zmq.POLLIN):
                    self.on_idle()
                    continue
                parts = self.sock.recv_multipart()
                if len(parts) != 2:
                    log.warning("dropped a message of %d parts", len(parts))
                    continue
                if not self.handle(parts[0], parts[1]):
                    break
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
