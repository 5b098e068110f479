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
  the tokens they generated) and finishes with the output it would have had.
"""
from __future__ import annotations

import logging
from collections import deque

from control_plane.request import Request
from control_plane.sequence import SeqStatus

log = logging.getLogger("pagedserve.control_plane")


class FailureIsolation:
    def __init__(self, engine):
        self.engine = engine
        self.unproven: set[int] = set()          # id() of requests with no successful step yet
        self.held: deque[Request] = deque()      # suspects waiting to run as the only one
        self.probe: Request | None = None        # the suspect let back, until a step of it succeeds

    def admitted(self, req: Request) -> None:
        if len(self.unproven) > 64 + 2 * len(self.engine.owners):
            # ids of requests that ended unproven: drop them (the live ones are all in owners)
            self.unproven &= {id(r) for r in self.engine.owners.values()}
        self.unproven.add(id(req))

    def _requests(self, out) -> list[Request]:
        found: dict[int, Request] = {}
        for s in out.scheduled:
            req = self.engine.owners.get(s.seq.seq_id)
            if req is not None and not req.finished:
                found[id(req)] = req
        return list(found.values())

    def on_success(self, out) -> None:
        for req in self._requests(out):
            self.unproven.discard(id(req))
            if req is self.probe:
                self.probe = None

    def on_failure(self, out, error: str) -> None:
        reqs = self._requests(out)
        unproven = [r for r in reqs if id(r) in self.unproven]
        if len(reqs) == 1 or len(unproven) == 1:
            guilty = reqs[0] if len(reqs) == 1 else unproven[0]
            log.error("step failed (%s); failing request %s, the only suspect of %d", error, guilty.request_id,
                      len(reqs))
            self._forget(guilty)
            self.engine.outputs.fail(guilty, error)
            for req in reqs:
                if req is not guilty:
                    self._requeue(req)
            return
        suspects = unproven or reqs
        log.error("step failed (%s) with %d suspect requests; they run one at a time to find the culprit",
                  error, len(suspects))
        for req in reqs:
            if req in suspects:
                self._take_out(req)
                if req is self.probe:
                    self.probe = None
                    self.held.appendleft(req)
                else:
                    self.held.append(req)
            else:
                self._requeue(req)

    def release(self) -> None:
        """Lets the next held suspect back once the previous one is proven (or ended)."""
        if self.probe is not None and (self.probe.finished or id(self.probe) not in self.unproven):
            self.probe = None
        while self.probe is None and self.held:
            req = self.held.popleft()
            if req.finished:
                continue   # aborted or timed out while held
            self.probe = req
            self._queue_front(req)

    # --- moving a request's sequences --------------------------------------------------------
    def _take_out(self, req: Request) -> None:
        """Out of the scheduler, blocks freed, forgotten by the data plane; still live for the API."""
        sched = self.engine.scheduler
        for seq in req.live_seqs():
            sched.finish(seq, "requeue")
            seq.status, seq.finish_reason, seq.num_computed_tokens = SeqStatus.WAITING, None, 0
        if req.beam is not None:
            req.beam.candidates.clear()   # the recomputed beams report again
        self.unproven.add(id(req))

    def _queue_front(self, req: Request) -> None:
        for seq in reversed(req.live_seqs()):
            self.engine.scheduler.waiting.appendleft(seq)
        self.engine._wakeup.set()

    def _requeue(self, req: Request) -> None:
        self._take_out(req)
        self._queue_front(req)

    def _forget(self, req: Request) -> None:
        self.unproven.discard(id(req))
