"""The control plane's step loop: schedule, send the plan, apply the result, stream to clients."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from control_plane import metrics
from control_plane.block_manager import BlockManager
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.dp_client import DataPlaneClient, DataPlaneDead
from control_plane.plan_builder import build_plan
from control_plane.sampling_params import SamplingParams, ValidationError
from control_plane.scheduler import Scheduler
from control_plane.sequence import Sequence
from shared.config import ControlPlaneConfig
from shared.protocol import Handshake, SampledToken

log = logging.getLogger("pagedserve.control_plane")
IDLE_PING_SECONDS = 5.0


@dataclass
class RequestOutput:
    """What one step added to one request."""
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


class RequestStream:
    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer):
        self.seq = seq
        self.detok = detok
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.seq.is_finished and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()


class Engine:
    def __init__(self, config: ControlPlaneConfig, client: DataPlaneClient, handshake: Handshake, tokenizer):
        self.config = config
        self.client = client
        self.hs = handshake
        self.tokenizer = tokenizer
        block_manager = BlockManager(handshake.num_device_blocks, handshake.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(handshake.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.streams: dict[int, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._step_id = 0
        self._stopping = False
        self.data_plane_alive = True
        self.stats = metrics.EngineStats(config.model_name)

    # --- requests ---------------------------------------------------------------------
    @property
    def pool_capacity_tokens(self) -> int:
        return self.hs.num_device_blocks * self.hs.block_size

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.hs.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise ValidationError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or lower max_tokens", "max_tokens",
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

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        self.validate_request(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), len(prompt_ids), params)
        stream = RequestStream(seq, IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop))
        self.streams[seq.seq_id] = stream
        self.scheduler.add(seq)
        self.stats.on_arrival(len(prompt_ids))
        self._wakeup.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        seq = stream.seq
        if not seq.is_finished:
            self._finish(stream, "abort")
            self._wakeup.set()

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
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_PING_SECONDS)
                except asyncio.TimeoutError:
                    await self._guarded(self.client.ping(self.config.step_timeout))
                continue
            await self._guarded(self.step())

    async def _guarded(self, work) -> None:
        """Runs one exchange with the data plane; if it died, fail what was in flight and wait for it."""
        try:
            await work
        except DataPlaneDead as exc:
            log.error("%s", exc)
            self.data_plane_alive = False
            for stream in list(self.streams.values()):
                self._finish(stream, "error", "the data plane stopped answering")
            while not self._stopping:
                try:
                    await self.client.handshake(IDLE_PING_SECONDS)
                    log.info("the data plane answers again")
                    self.data_plane_alive = True
                    return
                except DataPlaneDead:
                    continue

    async def step(self) -> None:
        out = self.scheduler.schedule()
        if not out.scheduled and not self.scheduler.running and self.scheduler.waiting and not out.forget_seq_ids:
            # nothing runs and the head of the queue still cannot get its blocks: it never will
            self._finish(self.streams[self.scheduler.waiting[0].seq_id], "error",
                         "the request does not fit the KV pool")
            return
        self._step_id += 1
        plan = build_plan(self._step_id, out, self.scheduler.bm, self.eos_token_ids)
        started = time.monotonic()
        result = await self.client.step(plan, self.config.step_timeout)
        self.stats.on_step(out, result, time.monotonic() - started, self.scheduler)
        if result.error:
            log.error("step %d failed on the data plane: %s", plan.step_id, result.error)
            for s in out.scheduled:
                if not s.seq.is_finished:
                    self._finish(self.streams[s.seq.seq_id], "error", result.error)
            return
        self.scheduler.on_step_done(out)
        for sampled in result.sampled:
            stream = self.streams.get(sampled.seq_id)
            if stream is not None and not stream.seq.is_finished:
                self._on_token(stream, sampled)

    def _on_token(self, stream: RequestStream, sampled: SampledToken) -> None:
        seq, params = stream.seq, stream.seq.params
        first = seq.num_output_tokens == 0
        seq.token_ids.append(sampled.token_id)
        seq.cumulative_logprob += sampled.logprob
        self.stats.on_token(seq, first)
        is_stop_token = (sampled.token_id in params.stop_token_ids
                         or (not params.ignore_eos and sampled.token_id in self.eos_token_ids))
        stream.detok.add(sampled.token_id, skip=is_stop_token)
        reason = None
        if is_stop_token and seq.num_output_tokens >= params.min_tokens:
            reason = "stop"
        elif seq.num_output_tokens >= params.min_tokens and stream.detok.find_stop():
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.hs.max_model_len:
            reason = "length"
        logprobs = [sampled] if params.logprobs is not None else []
        if reason:
            self._finish(stream, reason, token_ids=[sampled.token_id], logprobs=logprobs)
        else:
            stream.queue.put_nowait(RequestOutput(stream.detok.take_new_text(False), [sampled.token_id], logprobs,
                                                  num_prompt_tokens=seq.num_prompt_tokens,
                                                  num_output_tokens=seq.num_output_tokens))

    def _finish(self, stream: RequestStream, reason: str, error: str | None = None,
                token_ids: list[int] | None = None, logprobs: list[SampledToken] | None = None) -> None:
        seq = stream.seq
        self.scheduler.finish(seq, reason)
        self.streams.pop(seq.seq_id, None)
        self.stats.on_finish(seq, reason)
        stream.queue.put_nowait(RequestOutput(stream.detok.take_new_text(True), token_ids or [], logprobs or [],
                                              True, reason, seq.num_prompt_tokens, seq.num_output_tokens, error))

    def _log_progress(self, elapsed: float) -> None:
        s = self.scheduler
        log.info("running %d, waiting %d, KV usage %.1f%%, generation %.1f tokens/s, preemptions %d",
                 len(s.running), len(s.waiting), 100 * s.bm.usage(),
                 self.stats.take_generated() / max(elapsed, 1e-9), s.num_preemptions)

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        for stream in list(self.streams.values()):
            self._finish(stream, "abort")
