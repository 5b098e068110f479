"""The ranks of a tensor-parallel data plane at work: rank 0 talks to the control plane, the
others follow it.

    control plane ──ZeroMQ──► rank 0 ──(raw plan bytes, gloo)──► ranks 1..N-1
                  ◄─ result ─  │  every rank: swaps, copies, forward (all_reduce per row-parallel layer)
                               └─ rank 0 samples and sends the token ids; only rank 0 answers

Rank 0 forwards every step plan and the shutdown frame unchanged (the bytes it received), so
every rank decodes the same plan and applies it to its own sequence table and KV pool; block ids
mean the same on every rank. When no frame comes for HEARTBEAT_SECONDS it sends an empty frame,
which keeps the others' waits short and finds a dead rank while idle.

Failure: a collective that fails (a rank died, or the group timed out) is fatal for the rank that
sees it; the process exits, so the control plane sees its data plane dead and restarts it.
"""
from __future__ import annotations

import logging
import os

import torch.distributed as dist

from data_plane import tensor_parallel as TP
from data_plane.worker import Worker
from shared import protocol as P

log = logging.getLogger("pagedserve.data_plane")
HEARTBEAT_SECONDS = 2.0
FORWARDED = (P.STEP_PLAN, P.SHUTDOWN)
EXIT_GROUP_LOST = 3


def group_lost(exc: BaseException) -> bool:
    """Whether `exc`, raised inside a step, is a failed collective rather than a fault of the step:
    NCCL raises DistError; gloo raises a plain RuntimeError from its transport."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def die(comm: TP.Comm, exc: BaseException) -> None:
    """Ends this process at once: the group is broken and a clean shutdown would wait on dead peers."""
    log.critical("tensor-parallel rank %d of %d lost its group (%s: %s); exiting", comm.rank, comm.world_size,
                 type(exc).__name__, exc)
    logging.shutdown()
    os._exit(EXIT_GROUP_LOST)


class _LeaderRunner:
    """Rank 0's runner as the worker sees it: a group failure inside a step ends the process
    instead of becoming an error answer (the other ranks are gone or out of step)."""

    def __init__(self, runner, comm: TP.Comm):
        self.runner = runner
        self.comm = comm

    def handshake(self) -> P.Handshake:
        hs = self.runner.handshake()
        hs.device += f" x{self.comm.world_size} tensor-parallel ranks"
        return hs

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            if group_lost(exc):   # never answered as a failed step: the control plane would blame its requests
                die(self.comm, exc)
            raise


class LeaderWorker(Worker):
    def __init__(self, runner, comm: TP.Comm, listen: str, stats=None, **kwargs):
        super().__init__(_LeaderRunner(runner, comm), listen, stats, **kwargs)
        self.comm = comm
        if stats is not None:
            from prometheus_client import Counter
            self.comm_seconds = Counter(
                "pagedserve_data_plane_tp_comm_seconds_total",
                "Time rank 0 spent in tensor-parallel communication, by kind (all_reduce: activations after "
                "row-parallel layers; plan: step plans sent to the other ranks; tokens: sampled token ids)",
                ["model_name", "kind"], registry=stats.registry)
            for kind in comm.seconds:
                self.comm_seconds.labels(stats.model_name, kind)
            self._exported = dict(comm.seconds)

    def _send(self, frame: bytes) -> None:
        try:
            TP.send_bytes(self.comm, frame)
        except (dist.DistError, RuntimeError) as exc:
            die(self.comm, exc)

    def on_message(self, peer: bytes, kind: str, message, frame: bytes) -> bool:
        # only the owner's frames get here (the worker checks): others never reach the followers
        if kind in FORWARDED:
            self._send(frame)
        keep_going = super().on_message(peer, kind, message, frame)
        self._export_comm()
        return keep_going

    def _export_comm(self) -> None:
        if self.stats is None:
            return
        for kind, total in self.comm.seconds.items():
            self.comm_seconds.labels(self.stats.model_name, kind).inc(total - self._exported[kind])
            self._exported[kind] = total

    idle_seconds = HEARTBEAT_SECONDS

    def on_idle(self) -> None:
        self._send(b"")   # a heartbeat: followers blocked in a broadcast learn that rank 0 lives


def follow(runner, comm: TP.Comm) -> int:
    """Ranks 1..N-1: execute every plan rank 0 forwards, until it forwards the shutdown."""
    log.info("rank %d of %d following rank 0", comm.rank, comm.world_size)
    while True:
        try:
            frame = TP.recv_bytes(comm)
        except (dist.DistError, RuntimeError) as exc:
            die(comm, exc)
        if not frame:
            continue
        try:
            kind, message = P.decode(frame)
        except P.ProtocolError:
            continue
        if kind == P.SHUTDOWN:
            log.info("rank %d: shutdown", comm.rank)
            return 0
        try:
            runner.execute(message)
        except Exception as exc:
            if group_lost(exc):
                die(comm, exc)
            # rank 0 meets the same plan error and answers it; nothing to do here
            log.debug("rank %d: step %d failed", comm.rank, message.step_id, exc_info=True)
