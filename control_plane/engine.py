"""The control plane's step loop: schedule, send the plan, update the scheduler with the result,
emit the outputs; plus request admission, deadlines, and recovery from a data-plane restart.

What api.py, metrics and the router may use of an engine is the "interface" section below."""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass, field

from control_plane import metrics
from control_plane.beam_search import BeamSearch
from control_plane.block_manager import BlockManager
from control_plane.dp_client import DataPlaneDead
from control_plane.output_processor import OutputProcessor
from control_plane.preemption import PreemptionPolicy
from control_plane.request import Request
from control_plane.sampling_params import SamplingParams, ValidationError, check_for_model
from control_plane.scheduler import Scheduler, SchedulerLoad, is_empty
from control_plane.structured import GrammarBackend, Matchers
from control_plane.sequence import Sequence
from control_plane.serving import DataPlaneLink
from control_plane.step_failures import FailureIsolation
from shared.config import ControlPlaneConfig
from shared.protocol import Handshake, StepPlan, StepResult

log = logging.getLogger("pagedserve.control_plane")
IDLE_PING_SECONDS = 5.0
RESTART_SECONDS = 300.0   # a restarted data plane loads its model before it answers
SHUTDOWN_MESSAGE = "the server shut down before the request finished; send it again"


@dataclass
class InFlight:
    """A step sent to the data plane whose result is not applied yet."""
    plan: StepPlan
    sent_at: float          # time.monotonic() when it was sent
    # overlap: the sequences of a step that failed while this one ran. It ran them too, on state the failure
    # may have left half-updated, and cannot show who is guilty.
    distrusted: set[int] = field(default_factory=set)


class Engine:
    def __init__(self, config: ControlPlaneConfig, client: DataPlaneLink, handshake: Handshake, tokenizer):
        self.config = config
        self.client = client
        self.hs = handshake
        self.tokenizer = tokenizer
        block_manager = self._block_manager()
        self.policy = PreemptionPolicy(config.preemption_mode, PreemptionPolicy.block_bytes_of(handshake))
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.policy,
                                   overlap=config.async_scheduling)
        eos = set(handshake.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self._wakeup = asyncio.Event()
        self._in_flight: InFlight | None = None   # overlap: the step sent whose result is awaited next
        self._stopping = False
        self.draining = False  # graceful shutdown: requests in flight go on, new ones are refused
        self._deadlines: list[tuple[float, int, Request]] = []   # heap of (deadline, tie-break, request)
        self._answering = True   # False from a failed exchange until the data plane answers a handshake
        self.on_dead = None    # async callable that restarts the data plane, when this process spawned it
        # replicas (control_plane/failover.py): called with this engine when its data plane is declared
        # gone (its requests may move elsewhere) and when one answers again
        self.on_down = None
        self.on_up = None
        self.awaiting_handshake = False   # started while its data plane was down: run() connects first
        self.stats = metrics.EngineStats(config.model_name)
        self.outputs = OutputProcessor(self.stats, tokenizer, self.eos_token_ids, handshake.max_model_len)
        # a failed step fails only the request that caused it
        self.isolation = FailureIsolation(self.scheduler, self.outputs, self._wakeup.set)

    def health(self) -> dict:
        """/health's body while this engine serves (a router reports its replicas instead)."""
        return {"status": "ok"}

    def start_unconnected(self) -> None:
        """This engine's data plane did not answer at start: run() connects first, and until then the
        engine counts as down (the router sends it nothing)."""
        self.awaiting_handshake, self._answering = True, False

    def _block_manager(self) -> BlockManager:
        """An empty block manager for the data plane of the last handshake: its pools, its layer groups, and
        the window of each beyond which a sequence's blocks go back to the pool (0: it sees everything)."""
        hs, caching = self.hs, self.config.enable_prefix_caching
        if hs.num_state_slots and caching:
            log.warning("prefix caching is off: %s has layers that keep a per-sequence state (%d state slots), "
                        "which a cached prefix of KV blocks does not restore", hs.model_id, hs.num_state_slots)
        return BlockManager(hs.num_device_blocks, hs.block_size, enable_prefix_caching=caching,
                            num_cpu_blocks=hs.num_cpu_blocks, sliding_window=hs.sliding_window,
                            num_state_slots=hs.num_state_slots, group_reaches=hs.group_reaches)

    @property
    def owners(self) -> dict[int, Request]:
        """Live sequence id -> its request."""
        return self.outputs.owners

    # --- the interface api.py, metrics and the router use -----------------------------------
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def load(self) -> SchedulerLoad:
        return self.scheduler.load()

    def refresh_gauges(self) -> None:
        self.stats.refresh_gauges(self.load())

    @property
    def kv_block_bytes(self) -> int:
        return self.policy.block_bytes

    def kv_report(self) -> dict:
        """Block accounting for /debug/kv: blocks in use, queues, preemptions, the integrity check."""
        sched, bm = self.scheduler, self.scheduler.bm
        try:
            sched.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"violated: {exc}"
        cpu_total = bm.cpu_pool.num_blocks if bm.cpu_pool else 0
        slots = bm.state_slots
        return {"device_blocks": bm.pool.num_blocks, "device_blocks_used": bm.pool.num_blocks - bm.num_free_blocks(),
                "cpu_blocks": cpu_total, "cpu_blocks_used": cpu_total - (bm.cpu_pool.num_free if bm.cpu_pool else 0),
                "state_slots": slots.num_slots if slots else 0, "state_slots_used": slots.num_used if slots else 0,
                "running": len(sched.running), "waiting": len(sched.waiting), "swapped": len(sched.swapped),
                "preemptions": {"recompute": sched.num_preemptions, "swap": sched.num_swap_preemptions},
                "integrity": integrity}

    @property
    def data_plane_alive(self) -> bool:
        """What /health reports: the data plane answers, and the link to it is up (the client's
        socket monitor sees a disconnect at once; a lost link is re-established at the next ping)."""
        return self._answering and self.client.link_up

    # --- requests ---------------------------------------------------------------------
    @property
    def pool_capacity_tokens(self) -> int:
        """Tokens one sequence can ever hold: the pool less the blocks admission keeps free."""
        return (self.hs.num_device_blocks - self.scheduler.watermark_blocks) * self.hs.block_size

    def check_length(self, num_prompt_tokens: int, max_tokens: int, width: int = 1) -> None:
        limit = self.hs.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            # OpenAI's wording: clients (litellm, LangChain) recognise the context error by it
            raise ValidationError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.", "messages",
                "context_length_exceeded")
        bs = self.hs.block_size
        # A request can never run if its prompt cannot be admitted (admission keeps the watermark free)
        # or if its sequences cannot all grow to full length in the whole pool (running sequences may
        # use every block: the watermark holds back only new admissions). Sequences of one request
        # share the prompt's full blocks; each owns the rest of its context, its copy of a partly
        # filled last prompt block included.
        shared = num_prompt_tokens // bs
        prompt_blocks = -(-num_prompt_tokens // bs)
        total_blocks = shared + width * (-(-(num_prompt_tokens + max_tokens) // bs) - shared)
        pool = self.hs.num_device_blocks
        if prompt_blocks + self.scheduler.watermark_blocks > pool or total_blocks > pool:
            raise ValidationError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) for {width} "
                f"sequence{'s' if width > 1 else ''} needs {total_blocks} KV blocks of {bs} tokens (the prompt "
                f"{prompt_blocks}); this server's pool has {pool}, of which {self.scheduler.watermark_blocks} "
                "stay free for admission, so it can never run: shorten the prompt or lower max_tokens",
                "max_tokens", "context_length_exceeded")

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValidationError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.hs.vocab_size]
        if bad:
            raise ValidationError(f"token ids out of the vocabulary [0, {self.hs.vocab_size}): {bad[:5]}",
                                  "prompt", "invalid_token_id")
        check_for_model(params, self.hs.vocab_size, self.eos_token_ids)
        self.check_length(len(prompt_ids), params.max_tokens, params.best_of)
        slots = self.hs.num_state_slots
        if slots and params.best_of > slots:
            # each sequence of a request holds a state slot, and a request preempted whole comes back whole
            raise ValidationError(f"{params.best_of} sequences (n, best_of or the beam width) need as many state "
                                  f"slots; this model keeps a per-sequence state and the server has {slots}",
                                  "best_of")
        if params.constraint is not None:
            self._grammar_matchers().backend.compile(params.constraint)   # a bad grammar is a 400 here

    def _grammar_matchers(self) -> Matchers:
        """Structured output's matchers, made on the first constrained request (xgrammar loads then)."""
        if self.outputs.matchers is None:
            self.outputs.matchers = Matchers(GrammarBackend(self.tokenizer, self.hs.vocab_size, self.eos_token_ids))
        return self.outputs.matchers

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    timeout: float | None = None) -> Request:
        """Validates, then admits (the API validates a whole body first: control_plane/job.py)."""
        self.validate_request(prompt_ids, params)
        return self.admit(request_id, prompt_ids, params, timeout)

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              timeout: float | None = None) -> Request:
        """Queues a request that validate_request accepted. `timeout`: seconds after which it is aborted
        with finish reason "timeout"."""
        req = Request(request_id, prompt_ids, params, self.tokenizer)
        if timeout is not None:
            req.deadline = time.monotonic() + timeout
            self.watch_deadline(req)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params, params.spec(self.eos_token_ids))
        if params.use_beam_search:
            req.beam = BeamSearch(params.best_of, params.length_penalty, params.early_stopping, params.max_tokens,
                                  frozenset(params.stop_ids(self.eos_token_ids)))
            req.beam.start(seq.seq_id)
        self.outputs.register(req, seq)
        if params.constraint is not None:
            m = self._grammar_matchers()
            m.add(seq.seq_id, m.backend.compile(params.constraint))
        self.scheduler.add(seq)
        self.isolation.admitted(req)
        self.stats.on_arrival(len(prompt_ids))
        self._wakeup.set()
        return req

    def abort(self, req: Request, reason: str = "abort", error: str | None = None) -> None:
        """Ends a request wherever it is and frees its blocks: a client gone ("abort"), a deadline
        passed ("timeout"), or a shutdown ("abort" with an error the client is told)."""
        if not req.finished:
            self.scheduler.apply(self.outputs.finish_request(req, reason, error))
            self._wakeup.set()

    def watch_deadline(self, req: Request) -> None:
        heapq.heappush(self._deadlines, (req.deadline, id(req), req))

    def num_unfinished(self) -> int:
        return len(self.outputs.live_requests())

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        if len(self._deadlines) > 64 + 2 * len(self.owners):
            # most entries are requests that ended in time: drop them rather than hold them until their deadline
            self._deadlines = [d for d in self._deadlines if not d[2].finished]
            heapq.heapify(self._deadlines)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            # a request moved to another replica (failover.py) is that one's to end
            if not req.finished and any(seq_id in self.owners for seq_id in req.seqs):
                log.info("request %s passed its deadline; aborted", req.request_id)
                self.abort(req, "timeout")

    # --- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        if self.awaiting_handshake:
            await self._reconnect()
        last_log = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now - last_log >= self.config.log_interval:
                self._log_progress(now - last_log)
                last_log = now
            if not self._busy():
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), min(IDLE_PING_SECONDS, self.config.log_interval))
                except asyncio.TimeoutError:
                    await self._guarded(self.client.ping(self.config.step_timeout))
                continue
            self._expire_deadlines()   # before scheduling: an expired request takes no more steps
            if self._busy():
                await self._guarded(self.step())

    def _busy(self) -> bool:
        """Work queued, a step in flight, or failed-step suspects held back (step() lets them in)."""
        return self.scheduler.has_work() or self._in_flight is not None or bool(self.isolation.held)

    async def _guarded(self, work) -> None:
        """Runs one exchange with the data plane. If it died: restart it when we spawned it, wait
        until it answers, and re-queue every unfinished sequence for recompute (nothing is lost:
        sequences keep the tokens they generated and go on from there)."""
        try:
            await work
        except DataPlaneDead as exc:
            log.error("%s", exc)
            self._answering = False
            self._in_flight = None      # its result will never come: the sequences are recomputed
            if self.on_down is not None:
                self._reset_pool()      # the lost pool's blocks are free; its requests may move away
                self.on_down(self)
            await self._reconnect()

    async def _reconnect(self) -> None:
        """Until a data plane answers at this engine's address: restarts it when we spawned it, and
        asks for a handshake; then every sequence left here is recomputed on it."""
        while not self._stopping:
            if self.on_dead is not None:
                await self.on_dead()
            try:
                hs = await self._handshake_keeping_deadlines()
            except DataPlaneDead as again:
                log.error("%s", again)
                await asyncio.sleep(1.0)   # a refusal answers at once: do not spin
                continue
            if (hs.vocab_size, hs.block_size) != (self.hs.vocab_size, self.hs.block_size):
                log.error("the data plane at %s serves another model or block size (%s, block size %d) than "
                          "this server (%s, block size %d); it is not used", self.client.address, hs.model_id,
                          hs.block_size, self.hs.model_id, self.hs.block_size)
                await asyncio.sleep(self.config.step_timeout)
                continue
            self.hs = hs
            self.awaiting_handshake = False
            self._requeue_all()
            self._answering = True
            if self.on_up is not None:
                self.on_up(self)
            return

    async def _handshake_keeping_deadlines(self) -> Handshake:
        """The handshake; meanwhile the requests waiting here still end at their deadlines."""
        task = asyncio.ensure_future(self.client.handshake(self.config.step_timeout + RESTART_SECONDS))
        try:
            while not task.done():
                await asyncio.wait([task], timeout=1.0)
                self._expire_deadlines()
            return task.result()
        finally:
            task.cancel()

    def _reset_pool(self) -> int:
        """A new, empty pool for the data plane of the last handshake: every unfinished sequence
        waits to be recomputed. Returns how many."""
        num_seqs = self.scheduler.restart(self._block_manager())
        self.stats.on_new_block_manager()
        self.policy.block_bytes = PreemptionPolicy.block_bytes_of(self.hs)
        self.outputs.max_model_len = self.hs.max_model_len
        for req in self.outputs.live_requests():
            if req.beam is not None:
                req.beam.candidates.clear()   # recomputed beams report again
        return num_seqs

    def _requeue_all(self) -> None:
        """After a data-plane restart its pool is new and empty: every sequence starts over. The new
        data plane may differ (pool sizes, dtype): what depends on its handshake is renewed."""
        num_seqs = self._reset_pool()
        log.info("the data plane answers again; %d sequences re-queued for recompute", num_seqs)

    async def step(self) -> None:
        """One step: schedule, send, update, emit. With overlap (config.async_scheduling) step N+1 is
        sent before step N's result is awaited, so that this process handles N while the data plane
        computes N+1 (scheduler.py, top); otherwise the result is that of the plan just sent."""
        self.isolation.release()
        plan = self.scheduler.schedule()
        if self._fail_stuck(plan):
            return
        done = await self._send(plan)
        if done is not None:
            sent, result = done
            seqs = self.scheduler.update(sent.plan, result)
            self._observe(sent, result, seqs)
            self._emit(sent, result, seqs)

    def _fail_stuck(self, plan: StepPlan) -> bool:
        """Nothing runs and the head of the queue still cannot get its blocks: it never will."""
        sched = self.scheduler
        if not is_empty(plan) or self._in_flight is not None or sched.running or not (sched.swapped or sched.waiting):
            return False
        stuck = sched.swapped[0][0] if sched.swapped else sched.waiting[0]
        self.abort(self.owners[stuck.seq_id], "error", "the request does not fit the KV pool")
        return True

    async def _send(self, plan: StepPlan) -> tuple[InFlight, StepResult] | None:
        """Sends `plan` (with overlap, unless it is empty) and returns the step whose result came back:
        this one, or with overlap the one sent before (None when there was none)."""
        plan.token_masks = self.outputs.masks(plan)   # with overlap too: a constrained sequence is never planned ahead
        if not self.config.async_scheduling:
            return InFlight(plan, time.monotonic()), await self.client.step(plan, self.config.step_timeout)
        sent = None
        if not is_empty(plan):
            await self.client.send_plan(plan)
            sent = InFlight(plan, time.monotonic())
        previous, self._in_flight = self._in_flight, sent
        if previous is None:
            return None
        return previous, await self.client.result_of(previous.plan.step_id, self.config.step_timeout)

    def _observe(self, sent: InFlight, result: StepResult, seqs: list[Sequence]) -> None:
        plan = sent.plan
        self.stats.on_step(seqs, time.monotonic() - sent.sent_at, self.load())
        self.stats.on_swap(len(plan.swap_out), len(plan.swap_in))
        self.policy.observe(len(plan.swap_out) + len(plan.swap_in), result.swap_seconds, result.num_tokens,
                            result.forward_seconds)

    def _emit(self, sent: InFlight, result: StepResult, seqs: list[Sequence]) -> None:
        """The result's tokens to their requests; a failed step to the request that caused it."""
        suspects = sent.distrusted
        if suspects:
            # sent before a failure was handled: the failed step's sequences (recomputed, held or failed by
            # now) take nothing from it, and if it failed too it blames no one: its other requests are
            # recomputed, and a culprit among them fails again in a step of its own
            seqs = [s for s in seqs if s.seq_id not in suspects]
            result.sampled = [t for t in result.sampled if t.seq_id not in suspects]
            result.prompt_logprobs = [p for p in result.prompt_logprobs if p.seq_id not in suspects]
        if result.error:
            log.error("step %d failed on the data plane: %s", result.step_id, result.error)
            if suspects:
                self.isolation.recompute(seqs)
            else:
                self.isolation.on_failure(seqs, result.error)
            self._distrust_in_flight(seqs)
            return
        self.isolation.on_success(seqs)
        self.scheduler.apply(self.outputs.process(result))

    def _distrust_in_flight(self, seqs: list[Sequence]) -> None:
        """A failed step's sequences were moved (recomputed, held or failed): the step in flight, sent before
        that, ran them too (overlap)."""
        if self._in_flight is not None:
            self._in_flight.distrusted = {s.seq_id for s in seqs}

    def _log_progress(self, elapsed: float) -> None:
        s = self.scheduler
        log.info("running %d, waiting %d, swapped %d, KV usage %.1f%% (CPU %.1f%%), generation %.1f tokens/s, "
                 "preemptions %d recompute / %d swap", len(s.running), len(s.waiting), len(s.swapped),
                 100 * s.bm.usage(), 100 * s.bm.cpu_usage(), self.stats.take_generated() / max(elapsed, 1e-9),
                 s.num_preemptions, s.num_swap_preemptions)
        if s.bm.windowed:
            log.info("layer groups reading back %s positions (0: all): %d blocks freed so far because they "
                     "left a window", s.bm.reaches, s.bm.num_window_freed)

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        for req in self.outputs.live_requests():
            self.abort(req, error=SHUTDOWN_MESSAGE)
