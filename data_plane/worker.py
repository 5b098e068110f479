"""The data plane's ZeroMQ loop: answers the handshake, executes plans, answers pings.

A ROUTER socket bound at the listen address; one control plane talks to it through a DEALER.
Frames that do not decode are logged and dropped: they never stop the loop.

One control plane owns the data plane (two would each fill the same KV pool and sequence table
with their own ids and corrupt each other's answers):
- the first HELLO makes its sender the owner and hands it a random token;
- the owner's HELLO from a new socket (it reconnected, or it was restarted and read the token it
  had saved, control_plane/owner_tokens.py) carries the token and moves ownership to that
  socket at once, even while the old socket's link still looks up;
- a HELLO from anyone else is refused with an ERROR frame while the owner's link is up;
  once it is down (the owner's process ended, or it went silent past the ZMTP heartbeat
  timeout and the link was closed), the newcomer takes over: a restarted control plane
  is served without restarting the data plane;
- plans, pings and SHUTDOWN from anyone but the owner are ignored (a plan or ping gets an
  ERROR answer, so that a displaced control plane learns at once).
Whether the owner's link is up is asked of ZeroMQ itself: with ROUTER_MANDATORY, a send to a
peer whose connection is gone fails with EHOSTUNREACH.
"""
from __future__ import annotations

import errno
import logging
import secrets
import time

import zmq

from data_plane.model_runner import ModelRunner, PlanError
from shared import curve
from shared import protocol as P

log = logging.getLogger("pagedserve.data_plane")
HEARTBEAT_IVL_MS = 1000       # ZMTP pings to every peer ...
HEARTBEAT_TIMEOUT_MS = 10000  # ... a peer that does not answer is disconnected (and loses ownership)
MAX_TRACKED_PEERS = 1024      # peers remembered for "log once" (a flood must not grow memory)


class Worker:
    def __init__(self, runner: ModelRunner, listen: str, stats=None, curve_keys: str | None = None):
        self.runner = runner
        self.stats = stats   # data_plane.metrics.DataPlaneStats, or None
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a gone peer fails: the owner probe
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.auth = None     # the ZAP handler that admits only the authorized control plane (CURVE)
        if curve_keys:
            self.auth = curve.secure_server(self.ctx, self.sock, curve.load_server_keys(curve_keys))
            log.info("CURVE on: only the control plane holding the client key of %s is admitted", curve_keys)
        self.sock.bind(listen)
        self.listen = listen
        self.owner: bytes | None = None      # routing id of the owner's socket
        self.owner_token: str | None = None
        self.owner_since = 0.0
        self._logged: dict[tuple[bytes, str], int] = {}   # (peer, what) -> times seen

    def _reply(self, peer: bytes, kind: str, message=None) -> bool:
        """Sends one frame; False when the peer is gone (or cannot take it now)."""
        try:
            self.sock.send_multipart([peer, P.encode(kind, message)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.debug("could not send %s to a peer: %s", kind, exc)
            return False

    def _once(self, peer: bytes, what: str) -> bool:
        """True the first time `what` happens with `peer`: hostile traffic is logged once, not flooded."""
        if len(self._logged) > MAX_TRACKED_PEERS:
            self._logged.clear()
        count = self._logged.get((peer, what), 0) + 1
        self._logged[(peer, what)] = count
        return count == 1

    def _owner_link_up(self) -> bool:
        try:
            self.sock.send_multipart([self.owner, P.encode(P.PONG)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc.errno != errno.EHOSTUNREACH   # EAGAIN: connected, its queue is full
        return True

    def _hello(self, peer: bytes, hello: P.Hello) -> None:
        if self.owner is not None and peer != self.owner:
            if hello.token is not None and hello.token == self.owner_token:
                # it says HELLO again only after it declared this data plane gone (hung, cut off):
                # it has moved or re-queued every sequence, and sends the ones it keeps here anew
                log.info("the owning control plane reconnected (or was restarted with its saved token); its "
                         "sequences here are forgotten")
                self._forget_sequences()
            elif self._owner_link_up():
                if self._once(peer, "refused"):
                    log.warning("refused a second control plane: this data plane serves the one connected "
                                "since %s", time.strftime("%H:%M:%S", time.localtime(self.owner_since)))
                self._reply(peer, P.ERROR, "this data plane already serves another control plane, whose link "
                            "is up; one data plane serves one control plane: stop the other one, or start "
                            "another data plane for this one")
                return
            else:
                log.warning("the owning control plane's link is gone; a new control plane takes over")
                self._new_owner(peer)
        elif self.owner is None:
            self._new_owner(peer)
        self.owner = peer
        self._reply(peer, P.HANDSHAKE, self._handshake())

    def _new_owner(self, peer: bytes) -> None:
        self.owner, self.owner_token, self.owner_since = peer, secrets.token_hex(16), time.time()
        self._forget_sequences()   # the previous owner's: the new one numbers its own from scratch
        log.info("a control plane owns this data plane now")

    def _forget_sequences(self) -> None:
        seqs = getattr(self.runner, "seqs", None)
        if isinstance(seqs, dict):
            seqs.clear()

    def _handshake(self) -> P.Handshake:
        hs = self.runner.handshake()
        hs.owner_token = self.owner_token
        return hs

    def handle(self, peer: bytes, frame: bytes) -> bool:
        """Handles one frame; returns False when told to shut down."""
        try:
            kind, message = P.decode(frame)
        except P.ProtocolError as exc:
            if self._once(peer, "bad frame"):
                log.warning("dropped a frame (later bad frames of this peer are dropped silently): %s", exc)
            return True
        if kind == P.HELLO:
            self._hello(peer, message)
            return True
        if peer != self.owner:
            if self._once(peer, "not owner"):
                log.warning("ignored %s from a peer that does not own this data plane (later ones too)", kind)
            if kind in (P.STEP_PLAN, P.PING):
                self._reply(peer, P.ERROR, "this data plane is owned by another control plane; say HELLO first")
            return True
        return self.on_message(peer, kind, message, frame)

    def on_message(self, peer: bytes, kind: str, message, frame: bytes) -> bool:
        """A decoded frame from the owner; returns False when told to shut down."""
        if kind == P.PING:
            self._reply(peer, P.PONG)
        elif kind == P.STEP_PLAN:
            started = time.perf_counter()
            try:
                result = self.runner.execute(message)
            except PlanError as exc:
                log.error("refused plan %d: %s", message.step_id, exc)
                result = P.StepResult(message.step_id, error=f"bad plan: {exc}")
            except Exception as exc:   # a fault in the step: answer, never die
                log.exception("step %d failed", message.step_id)
                result = P.StepResult(message.step_id, error=f"step failed: {type(exc).__name__}: {exc}")
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
                    if self._once(parts[0], "parts"):
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
