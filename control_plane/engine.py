"""The control plane's step loop: schedule, send the plan, apply the result, stream to clients."""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import defaultdict

from control_plane import metrics
from control_plane.beam_search import BeamSearch
from control_plane.block_manager import BlockManager
from control_plane.dp_client import DataPlaneClient, DataPlaneDead
from control_plane.plan_builder import build_plan
from control_plane.preemption import PreemptionPolicy
from control_plane.request import Request, RequestOutput
from control_plane.sampling_params import SamplingParams, ValidationError
from control_plane.scheduler import Scheduler
from control_plane.structured import GrammarBackend, Matchers
from control_plane.sequence import Sequence, SeqStatus
from shared.config import ControlPlaneConfig
from shared.protocol import Handshake, SampledToken

log = logging.getLogger("pagedserve.control_plane")
IDLE_PING_SECONDS = 5.0
RESTART_SECONDS = 300.0   # a restarted data plane loads its model before it answers
SHUTDOWN_MESSAGE = "the server shut down before the request finished; send it again"


class Engine:
    def __init__(self, config: ControlPlaneConfig, client: DataPlaneClient, handshake: Handshake, tokenizer):
        self.config = config
        self.client = client
        self.hs = handshake
        self.tokenizer = tokenizer
        block_manager = BlockManager(handshake.num_device_blocks, handshake.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching,
                                     num_cpu_blocks=handshake.num_cpu_blocks)
        self.policy = PreemptionPolicy(config.preemption_mode, PreemptionPolicy.block_bytes_of(handshake))
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.policy)
        eos = set(handshake.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.owners: dict[int, Request] = {}   # live sequence id -> its request
        self._wakeup = asyncio.Event()
        self._step_id = 0
        self._stopping = False
        self.draining = False  # graceful shutdown: requests in flight go on, new ones are refused
        self._deadlines: list[tuple[float, int, Request]] = []   # heap of (deadline, tie-break, request)
        self.data_plane_alive = True
        self.on_dead = None    # async callable that restarts the data plane, when this process spawned it
        self.stats = metrics.EngineStats(config.model_name)
        self.matchers: Matchers | None = None   # structured output, made on the first constrained request

    # --- requests ---------------------------------------------------------------------
    @property
    def pool_capacity_tokens(self) -> int:
        return self.hs.num_device_blocks * self.hs.block_size

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.hs.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            # OpenAI's wording: clients (litellm, LangChain) recognise the context error by it
            raise ValidationError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.", "messages",
                "context_length_exceeded")
        if num_prompt_tokens + max_tokens > self.pool_capacity_tokens:
            raise ValidationError(
                f"the prompt plus max_tokens ({num_prompt_tokens + max_tokens} tokens) can never fit the KV "
                f"pool of {self.pool_capacity_tokens} tokens", "max_tokens", "context_length_exceeded")

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValidationError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.hs.vocab_size]
        if bad:
            raise ValidationError(f"token ids out of the vocabulary [0, {self.hs.vocab_size}): {bad[:5]}",
                                  "prompt", "invalid_token_id")
        self.check_length(len(prompt_ids), params.max_tokens)
        if params.constraint is not None:
            self._grammar_matchers().backend.compile(params.constraint)   # a bad grammar is a 400 here

    def _grammar_matchers(self) -> Matchers:
        if self.matchers is None:
            self.matchers = Matchers(GrammarBackend(self.tokenizer, self.hs.vocab_size, self.eos_token_ids))
        return self.matchers

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    timeout: float | None = None) -> Request:
        """`timeout`: seconds after which the request is aborted with finish reason "timeout"."""
        self.validate_request(prompt_ids, params)
        req = Request(request_id, prompt_ids, params, self.tokenizer)
        if timeout is not None:
            req.deadline = time.monotonic() + timeout
            heapq.heappush(self._deadlines, (req.deadline, id(req), req))
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params, params.spec(self.eos_token_ids))
        if params.use_beam_search:
            req.beam = BeamSearch(params.best_of, params.length_penalty, params.early_stopping, params.max_tokens,
                                  frozenset(params.stop_ids(self.eos_token_ids)))
            req.beam.start(seq.seq_id)
        self._register(req, seq)
        if params.constraint is not None:
            m = self._grammar_matchers()
            m.add(seq.seq_id, m.backend.compile(params.constraint))
        self.scheduler.add(seq)
        self.stats.on_arrival(len(prompt_ids))
        self._wakeup.set()
        return req

    def _register(self, req: Request, seq: Sequence) -> None:
        req.add_seq(seq)
        self.owners[seq.seq_id] = req

    def abort(self, req: Request, reason: str = "abort", error: str | None = None) -> None:
        """Ends a request wherever it is and frees its blocks: a client gone ("abort"), a deadline
        passed ("timeout"), or a shutdown ("abort" with an error the client is told)."""
        if not req.finished:
            for seq in req.live_seqs():
                self._end_seq(req, seq, reason, error)
            self._close(req, reason)
            self._wakeup.set()

    def num_unfinished(self) -> int:
        return len({id(r) for r in self.owners.values()})

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        if len(self._deadlines) > 64 + 2 * len(self.owners):
            # most entries are requests that ended in time: drop them rather than hold them until their deadline
            self._deadlines = [d for d in self._deadlines if not d[2].finished]
            heapq.heapify(self._deadlines)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if not req.finished:
                log.info("request %s passed its deadline; aborted", req.request_id)
                self.abort(req, "timeout")

    # --- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        last_log = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now - last_log >= self.config.log_interval:
                self._log_progress(now - last_log)
                last_log = now
            if not self.scheduler.has_work():
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), min(IDLE_PING_SECONDS, self.config.log_interval))
                except asyncio.TimeoutError:
                    await self._guarded(self.client.ping(self.config.step_timeout))
                continue
            self._expire_deadlines()   # before scheduling: an expired request takes no more steps
            if self.scheduler.has_work():
                await self._guarded(self.step())

    async def _guarded(self, work) -> None:
        """Runs one exchange with the data plane. If it died: restart it when we spawned it, wait
        until it answers, and re-queue every unfinished sequence for recompute (nothing is lost:
        sequences keep the tokens they generated and go on from there)."""
        try:
            await work
        except DataPlaneDead as exc:
            log.error("%s", exc)
            self.data_plane_alive = False
            while not self._stopping:
                if self.on_dead is not None:
                    await self.on_dead()
                try:
                    self.hs = await self.client.handshake(self.config.step_timeout + RESTART_SECONDS)
                except DataPlaneDead as again:
                    log.error("%s", again)
                    continue
                self._requeue_all()
                self.data_plane_alive = True
                return

    def _requeue_all(self) -> None:
        """After a data-plane restart its pool is new and empty: every sequence starts over."""
        num_seqs = self.scheduler.restart(BlockManager(
            self.hs.num_device_blocks, self.hs.block_size, enable_prefix_caching=self.config.enable_prefix_caching,
            num_cpu_blocks=self.hs.num_cpu_blocks))
        for req in {id(r): r for r in self.owners.values()}.values():
            if req.beam is not None:
                req.beam.candidates.clear()   # recomputed beams report again
        log.info("the data plane answers again; %d sequences re-queued for recompute", num_seqs)

    async def step(self) -> None:
        out = self.scheduler.schedule()
        sched = self.scheduler
        if out.is_empty and not sched.running and (sched.swapped or sched.waiting):
            # nothing runs and the head of the queue still cannot get its blocks: it never will
            stuck = sched.swapped[0][0] if sched.swapped else sched.waiting[0]
            self._fail(self.owners[stuck.seq_id], "the request does not fit the KV pool")
            return
        self._step_id += 1
        plan = build_plan(self._step_id, out, self.scheduler.bm)
        if self.matchers is not None and self.matchers.by_seq:
            plan.token_masks = self.matchers.step_masks(out.scheduled)
        started = time.monotonic()
        result = await self.client.step(plan, self.config.step_timeout)
        self.stats.on_step(out, result, time.monotonic() - started, self.scheduler)
        if out.swapped_out:
            self.stats.on_preemption("swap", len(out.swapped_out))
        if out.swap_out or out.swap_in:
            self.stats.on_swap(len(out.swap_out), len(out.swap_in))
        self.policy.observe(len(out.swap_out) + len(out.swap_in), result.swap_seconds, result.num_tokens,
                            result.forward_seconds)
        if result.error:
            log.error("step %d failed on the data plane: %s", plan.step_id, result.error)
            for s in out.scheduled:
                req = self.owners.get(s.seq.seq_id)
                if req is not None and not req.finished:
                    self._fail(req, result.error)
            return
        self.scheduler.on_step_done(out)
        self._apply_result(result.sampled)

    # --- applying a step's result -------------------------------------------------------
    def _apply_result(self, sampled: list[SampledToken]) -> None:
        draws: dict[int, list[SampledToken]] = defaultdict(list)
        for tok in sampled:
            draws[tok.seq_id].append(tok)
        beam_requests = []
        for seq_id, seq_draws in draws.items():
            req = self.owners.get(seq_id)
            if req is None or req.finished or req.seqs[seq_id].is_finished:
                continue   # aborted while the step ran
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
                self._register(req, child)
                if self.matchers is not None:
                    self.matchers.fork(seq.seq_id, child.seq_id, child.output_token_ids)
                self.scheduler.fork(seq, child)
                self._on_token(req, child, draw)
            self._on_token(req, seq, seq_draws[0])
        for req in beam_requests:
            self._beam_step(req)

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
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.hs.max_model_len:
            reason = "length"
        logprobs = [sampled] if params.logprobs is not None else []
        if not req.buffered:
            req.emit(RequestOutput(seq.sample_index, detok.take_new_text(reason is not None), [sampled.token_id],
                                   logprobs, reason is not None, reason, seq.num_prompt_tokens,
                                   seq.num_output_tokens))
        if reason:
            self._end_seq(req, seq, reason)
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
        self._close(req, ranked[0].finish_reason, sum(s.num_output_tokens for s in ranked))

    def _beam_step(self, req: Request) -> None:
        beam = req.beam
        live = [s for s in req.live_seqs() if s.seq_id in beam.scores]
        choices, done = beam.step({s.seq_id: s.output_token_ids for s in live})
        if done:
            for seq in live:
                self._end_seq(req, seq, "beam_done")
            best = beam.best(req.params.n)
            for index, hyp in enumerate(best):
                text = self.tokenizer.decode(hyp.output_ids, skip_special_tokens=True)
                req.emit(RequestOutput(index, text, hyp.output_ids, [], True, hyp.finish_reason,
                                       len(req.prompt_ids), len(hyp.output_ids)))
            returned = sum(len(h.output_ids) for h in best)
            self.stats.on_generated(returned)
            self._close(req, best[0].finish_reason if best else "length", returned)
            return
        picks: dict[int, list] = defaultdict(list)
        for choice in choices:
            picks[choice.parent_seq_id].append(choice)
        for seq in live:            # dropped beams first: their blocks make room for the copies
            if not picks[seq.seq_id]:
                self._end_seq(req, seq, "beam_pruned")
        for seq in live:
            mine = picks[seq.seq_id]
            for extra in mine[1:]:
                child = Sequence(req.request_id, list(seq.token_ids), seq.num_prompt_tokens, req.params, seq.spec,
                                 sample_index=len(req.seqs), arrival_time=seq.arrival_time)
                self._register(req, child)
                if seq.status is SeqStatus.RUNNING:
                    self.scheduler.fork(seq, child)      # shares every block, copy-on-write
                else:
                    self.scheduler.add(child)            # the parent was preempted: recompute
                child.token_ids.append(extra.token_id)
                beam.scores[child.seq_id] = extra.score
            if mine:
                seq.token_ids.append(mine[0].token_id)
                beam.scores[seq.seq_id] = mine[0].score

    def _end_seq(self, req: Request, seq: Sequence, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        self.owners.pop(seq.seq_id, None)
        if self.matchers is not None:
            self.matchers.drop(seq.seq_id)
        self.stats.on_seq_end(seq)
        if error is not None or (reason in ("abort", "timeout") and not req.buffered):
            detok = req.detoks.get(seq.sample_index)
            req.emit(RequestOutput(seq.sample_index, detok.take_new_text(True) if detok else "", [], [], True,
                                   reason, seq.num_prompt_tokens, seq.num_output_tokens, error))

    def _close(self, req: Request, reason: str, num_output_tokens: int = 0) -> None:
        req.finished = True
        req.end_reason = reason
        first_seq = next(iter(req.seqs.values()))
        self.stats.on_finish(first_seq, reason, num_output_tokens)
        req.emit(RequestOutput(-1, "", [], [], True, None))   # wakes a reader waiting on the queue

    def _fail(self, req: Request, error: str) -> None:
        for seq in req.live_seqs():
            self._end_seq(req, seq, "error", error)
        self._close(req, "error")

    def _log_progress(self, elapsed: float) -> None:
        s = self.scheduler
        log.info("running %d, waiting %d, swapped %d, KV usage %.1f%% (CPU %.1f%%), generation %.1f tokens/s, "
                 "preemptions %d recompute / %d swap", len(s.running), len(s.waiting), len(s.swapped),
                 100 * s.bm.usage(), 100 * s.bm.cpu_usage(), self.stats.take_generated() / max(elapsed, 1e-9),
                 s.num_preemptions, s.num_swap_preemptions)

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        for req in {id(r): r for r in self.owners.values()}.values():
            self.abort(req, error=SHUTDOWN_MESSAGE)
