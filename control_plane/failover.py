"""Moving requests between replicas: a replica whose data plane is gone (killed, or silent past the
step timeout or the link's heartbeat) hands its unfinished requests to the live replicas, where
they are recomputed.

A request moves whole: the same Request object (the API keeps reading its queue), with the same
sequences, each keeping the tokens it generated and its detokenizer. The new replica computes
the prompt and those tokens again, then samples the next one, so a stream goes on where it
stopped and no token the client has is sent twice. Greedy outputs are the same as undisturbed;
seeded sampling draws from the data plane's generator and may differ after a move.
"""
from __future__ import annotations

import logging

from control_plane.request import Request

log = logging.getLogger("pagedserve.control_plane")


def detach(engine) -> list[Request]:
    """Takes every unfinished request out of `engine` (whose pool was reset: all its sequences are
    waiting): out of its scheduler, its sequence map, its grammar matchers and its suspects."""
    requests = engine.outputs.live_requests()
    moving = {id(r) for r in requests}
    waiting = engine.scheduler.waiting
    keep = [s for s in waiting if id(engine.owners.get(s.seq_id)) not in moving]
    waiting.clear()
    waiting.extend(keep)
    matchers = engine.outputs.matchers
    for req in requests:
        for seq in req.live_seqs():
            engine.owners.pop(seq.seq_id, None)
            if matchers is not None:
                matchers.drop(seq.seq_id)
    isolation = engine.isolation
    isolation.held = type(isolation.held)(r for r in isolation.held if id(r) not in moving)
    if isolation.probe is not None and id(isolation.probe) in moving:
        isolation.probe = None
    return requests


def adopt(engine, req: Request, replica: int) -> None:
    """Queues a detached request on `engine` (replica number `replica`) for recompute."""
    for seq in req.live_seqs():
        engine.outputs.register(req, seq)
        engine.scheduler.add(seq)
    if req.params.constraint is not None:
        matchers = engine._grammar_matchers()
        compiled = matchers.backend.compile(req.params.constraint)
        for seq in req.live_seqs():
            matchers.add(seq.seq_id, compiled, seq.output_token_ids)
    if req.beam is not None:
        req.beam.candidates.clear()   # the recomputed beams report again
    engine.isolation.admitted(req)
    if req.deadline is not None:
        engine.watch_deadline(req)
    req.replica = replica
    engine._wakeup.set()


def move(requests: list[Request], engines: list, targets: list[int]) -> int:
    """Adopts each request by the least loaded of `targets` (replica numbers); returns how many moved."""
    for req in requests:
        replica = min(targets, key=lambda i: (engines[i].num_unfinished(), i))
        adopt(engines[replica], req, replica)
        log.info("request %s moved to replica %d, where it is recomputed (%d tokens generated so far)",
                 req.request_id, replica, sum(s.num_output_tokens for s in req.live_seqs()))
    return len(requests)
