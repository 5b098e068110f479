"""A failed step belongs to the request that caused it, not to every request in the batch.

Requests are validated before they are queued, so a step should not fail; when one does (the
data plane answers an error for the whole step), this finds the culprit:

- a request is *proven* once a step it took part in succeeded (since it was last queued);
- a failed step with one request, or with one unproven request among proven ones, fails that
  request only: the proven ones ran before, the newcomer is the suspect;
- otherwise every unproven request of the step (or, if all were proven, every request of it)
  is held aside, and they are let back one at a time, each the only suspect of its steps;
- every other request of the failed step is re-queued for recompute: the data plane may hold
  half-updated state for it, which it forgets; the request loses nothing (its sequences keep
  the tokens they generated) and finishes with the output it would have had;
- with overlap, the step sent while the failed one ran holds the same sequences: the engine drops
  what it gives them, and if it fails too it blames no one (its other requests are recomputed).
"""
from __future__ import annotations

import logging
from collections import deque

from control_plane.output_processor import OutputProcessor
from control_plane.request import Request
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence

log = logging.getLogger("pagedserve.control_plane")


class FailureIsolation:
    """`wake`: called when held requests are queued again, so that an idle engine loop runs them."""

    def __init__(self, scheduler: Scheduler, outputs: OutputProcessor, wake):
        self.scheduler = scheduler
        self.outputs = outputs
        self.wake = wake
        self.unproven: set[int] = set()          # id() of requests with no successful step yet
        self.held: deque[Request] = deque()      # suspects waiting to run as the only one
        self.probe: Request | None = None        # the suspect let back, until a step of it succeeds

    def forget(self, requests: list[Request]) -> None:
        """These requests leave this engine (moved to another replica): no longer held or probed here."""
        moving = {id(r) for r in requests}
        self.held = deque(r for r in self.held if id(r) not in moving)
        if self.probe is not None and id(self.probe) in moving:
            self.probe = None
        self.unproven -= moving

    def admitted(self, req: Request) -> None:
        owners = self.outputs.owners
        if len(self.unproven) > 64 + 2 * len(owners):
            # ids of requests that ended unproven: drop them (the live ones are all in owners)
            self.unproven &= {id(r) for r in owners.values()}
        self.unproven.add(id(req))

    def _requests(self, seqs: list[Sequence]) -> list[Request]:
        found: dict[int, Request] = {}
        for seq in seqs:
            req = self.outputs.owners.get(seq.seq_id)
            if req is not None and not req.finished:
                found[id(req)] = req
        return list(found.values())

    def on_success(self, seqs: list[Sequence]) -> None:
        """A step of `seqs` succeeded: their requests are proven."""
        for req in self._requests(seqs):
            self.unproven.discard(id(req))
            if req is self.probe:
                self.probe = None

    def on_failure(self, seqs: list[Sequence], error: str) -> None:
        """A step of `seqs` failed with `error`."""
        reqs = self._requests(seqs)
        unproven = [r for r in reqs if id(r) in self.unproven]
        if len(reqs) == 1 or len(unproven) == 1:
            guilty = reqs[0] if len(reqs) == 1 else unproven[0]
            log.error("step failed (%s); failing request %s, the only suspect of %d", error, guilty.request_id,
                      len(reqs))
            self.unproven.discard(id(guilty))
            self.scheduler.apply(self.outputs.finish_request(guilty, "error", error))
            for req in reqs:
                if req is not guilty:
                    self._recompute(req, self.scheduler.requeue_front)
            return
        suspects = unproven or reqs
        log.error("step failed (%s) with %d suspect requests; they run one at a time to find the culprit",
                  error, len(suspects))
        for req in reqs:
            if req in suspects:
                self._recompute(req, self.scheduler.set_aside)
                if req is self.probe:
                    self.probe = None
                    self.held.appendleft(req)
                else:
                    self.held.append(req)
            else:
                self._recompute(req, self.scheduler.requeue_front)

    def recompute(self, seqs: list[Sequence]) -> None:
        """The live requests of `seqs` start over, blamed for nothing."""
        for req in self._requests(seqs):
            self._recompute(req, self.scheduler.requeue_front)

    def release(self) -> None:
        """Lets the next held suspect back once the previous one is proven (or ended)."""
        if self.probe is not None and (self.probe.finished or id(self.probe) not in self.unproven):
            self.probe = None
        while self.probe is None and self.held:
            req = self.held.popleft()
            if req.finished:
                continue   # aborted or timed out while held
            self.probe = req
            self.scheduler.requeue_front(req.live_seqs())
            self.wake()

    def _recompute(self, req: Request, move) -> None:
        """The request's sequences start over (`move`: the scheduler's requeue_front, or set_aside to
        hold them); the data plane forgets them. They stay live for the API."""
        move(req.live_seqs())
        if req.beam is not None:
            req.beam.candidates.clear()   # the recomputed beams report again
        self.unproven.add(id(req))
