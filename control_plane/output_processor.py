"""Applies what a step sampled to the requests: appends tokens, checks stops and lengths,
detokenizes, forks parallel samples, advances beams, and completes requests.

It owns the map from live sequence to request. It never touches the scheduler: process() and
finish_request() return what they decided about sequences (scheduler.Finish, scheduler.Fork), in order, for
Scheduler.apply to carry out (free the blocks, tell the data plane to forget, share the blocks).
A sequence decided finished has its finish_reason set at once, so that the rest of the same
result sees it ended.
"""
from __future__ import annotations

import logging

from collections import defaultdict

from control_plane import prompt_scoring
from control_plane.request import Request, RequestOutput
from control_plane.scheduler import Finish, Fork
from control_plane.sequence import Sequence
from shared.protocol import SampledToken, StepPlan, StepResult

log = logging.getLogger("pagedserve.control_plane")


class OutputProcessor:
    def __init__(self, stats, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.stats = stats
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len      # the engine updates it when a new data plane answers
        self.owners: dict[int, Request] = {}    # live sequence id -> its request
        self.matchers = None                     # structured output (control_plane.structured.Matchers)
        self._decided: list = []                 # Finish / Fork decisions of the call under way

    def register(self, req: Request, seq: Sequence) -> None:
        req.add_seq(seq)
        self.owners[seq.seq_id] = req

    def live_requests(self) -> list[Request]:
        return list({id(r): r for r in self.owners.values()}.values())

    def _take(self) -> list:
        decided, self._decided = self._decided, []
        return decided

    def masks(self, plan: StepPlan) -> list[tuple[int, bytes]]:
        """Token masks of the constrained sequences that sample in `plan` (none without structured output)."""
        if self.matchers is None or not self.matchers.by_seq:
            return []
        seq_ids = [s.seq_id for s in plan.new_seqs] + [s.seq_id for s in plan.cached_seqs]
        return self.matchers.step_masks([self.owners[i].seqs[i] for i in seq_ids if i in self.owners])

    # --- a step's result ------------------------------------------------------------------
    def process(self, result: StepResult) -> list:
        """Appends a step's sampled tokens and emits what they add; returns the decisions about
        sequences. The step's prompt log-probs are recorded before the tokens so that a request's
        prompt log-probs are whole when its first output is emitted."""
        prompt_scoring.record(self.owners, result.prompt_logprobs)
        draws: dict[int, list[SampledToken]] = defaultdict(list)
        for tok in result.sampled:
            draws[tok.seq_id].append(tok)
        beam_requests = []
        for seq_id, seq_draws in draws.items():
            req = self.owners.get(seq_id)
            if req is None or req.finished or req.seqs[seq_id].is_finished:
                continue   # ended (aborted, timed out, stopped) while the step ran: its token is dropped
            seq = req.seqs[seq_id]
            if req.beam is not None:
                req.beam.report(seq_id, seq_draws[0].top_logprobs)
                if req.beam.ready() and req not in beam_requests:
                    beam_requests.append(req)
                continue
            for j, draw in enumerate(seq_draws[1:], start=1):
                # parallel sampling: sample j forks from the prompt the samples share
                child = Sequence(req.request_id, list(seq.token_ids), seq.num_prompt_tokens, req.params,
                                 req.params.spec(self.eos_token_ids, draw=j), sample_index=j,
                                 arrival_time=seq.arrival_time)
                self.register(req, child)
                if self.matchers is not None:
                    self.matchers.fork(seq.seq_id, child.seq_id, child.output_token_ids)
                self._decided.append(Fork(seq, child))
                self._on_token(req, child, draw)
            self._on_token(req, seq, seq_draws[0])
        for req in beam_requests:
            self._beam_step(req)
        return self._take()

    def _on_token(self, req: Request, seq: Sequence, sampled: SampledToken) -> None:
        params = req.params
        first = seq.num_output_tokens == 0
        if self.matchers is not None and not self.matchers.accept(seq.seq_id, sampled.token_id):
            log.error("sequence %d sampled token %d outside its grammar", seq.seq_id, sampled.token_id)
        seq.token_ids.append(sampled.token_id)
        seq.cumulative_logprob += sampled.logprob
        self.stats.on_token(seq, first and seq.sample_index == 0)   # one first token per request
        detok = req.detoks[seq.sample_index]
        is_stop_token = sampled.token_id in seq.spec.stop_token_ids
        detok.add(sampled.token_id, skip=is_stop_token)
        reason = None
        if seq.num_output_tokens >= params.min_tokens and (is_stop_token or detok.find_stop()):
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        logprobs = [sampled] if params.logprobs is not None else []
        if not req.buffered:
            req.emit(RequestOutput(seq.sample_index, detok.take_new_text(reason is not None), [sampled.token_id],
                                   logprobs, reason is not None, reason, seq.num_prompt_tokens,
                                   seq.num_output_tokens))
        if reason:
            self._finish_seq(req, seq, reason)
            if not req.live_seqs():
                self._complete(req)

    def _complete(self, req: Request) -> None:
        """All sequences ended: hand out the chosen ones if they were held back."""
        ranked = sorted(req.seqs.values(), key=lambda s: -s.cumulative_logprob)[:req.params.n]
        if req.buffered:
            for index, seq in enumerate(ranked):
                detok = req.detoks[seq.sample_index]
                req.emit(RequestOutput(index, detok.take_new_text(True), seq.output_token_ids, [], True,
                                       seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens))
        else:
            ranked = sorted(req.seqs.values(), key=lambda s: s.sample_index)
        self._mark_finished(req, ranked[0].finish_reason, sum(s.num_output_tokens for s in ranked))

    def _beam_step(self, req: Request) -> None:
        beam = req.beam
        live = [s for s in req.live_seqs() if s.seq_id in beam.scores]
        choices, done = beam.step({s.seq_id: s.output_token_ids for s in live})
        if done:
            for seq in live:
                self._finish_seq(req, seq, "beam_done")
            best = beam.best(req.params.n)
            for index, hyp in enumerate(best):
                text = self.tokenizer.decode(hyp.output_ids, skip_special_tokens=True)
                req.emit(RequestOutput(index, text, hyp.output_ids, [], True, hyp.finish_reason,
                                       len(req.prompt_ids), len(hyp.output_ids)))
            returned = sum(len(h.output_ids) for h in best)
            self.stats.on_generated(returned)
            self._mark_finished(req, best[0].finish_reason if best else "length", returned)
            return
        picks: dict[int, list] = defaultdict(list)
        for choice in choices:
            picks[choice.parent_seq_id].append(choice)
        for seq in live:            # dropped beams first: their blocks make room for the copies
            if not picks[seq.seq_id]:
                self._finish_seq(req, seq, "beam_pruned")
        for seq in live:
            mine = picks[seq.seq_id]
            for extra in mine[1:]:
                child = Sequence(req.request_id, list(seq.token_ids), seq.num_prompt_tokens, req.params, seq.spec,
                                 sample_index=len(req.seqs), arrival_time=seq.arrival_time)
                self.register(req, child)
                self._decided.append(Fork(seq, child))
                child.token_ids.append(extra.token_id)
                beam.scores[child.seq_id] = extra.score
            if mine:
                seq.token_ids.append(mine[0].token_id)
                beam.scores[seq.seq_id] = mine[0].score

    # --- ending sequences and requests ----------------------------------------------------
    def finish_request(self, req: Request, reason: str, error: str | None = None) -> list:
        """Ends a request from outside a step (abort, timeout, shutdown, a failed step: `error` is
        what its client is told): every live sequence ends with `reason`. Returns the decisions."""
        for seq in req.live_seqs():
            self._finish_seq(req, seq, reason, error)
        self._mark_finished(req, reason)
        return self._take()

    def _finish_seq(self, req: Request, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason = reason
        self._decided.append(Finish(seq, reason))
        self.owners.pop(seq.seq_id, None)
        if self.matchers is not None:
            self.matchers.drop(seq.seq_id)
        self.stats.on_seq_end(seq)
        if error is not None or (reason in ("abort", "timeout") and not req.buffered):
            detok = req.detoks.get(seq.sample_index)
            req.emit(RequestOutput(seq.sample_index, detok.take_new_text(True) if detok else "", [], [], True,
                                   reason, seq.num_prompt_tokens, seq.num_output_tokens, error))

    def _mark_finished(self, req: Request, reason: str, num_output_tokens: int = 0) -> None:
        req.finished = True
        req.end_reason = reason
        first_seq = next(iter(req.seqs.values()))
        self.stats.on_finish(first_seq, reason, num_output_tokens)
        req.emit(RequestOutput(-1, "", [], [], True, None))   # wakes a reader waiting on the queue
