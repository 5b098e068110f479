"""A client request as the engine tracks it: its sequences (one, n parallel samples, or beams),
their detokenizers, and the queue of outputs the API reads."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from control_plane.beam_search import BeamSearch
from control_plane.detokenizer import IncrementalDetokenizer
from control_plane.sampling_params import SamplingParams
from control_plane.sequence import Sequence
from shared.protocol import SampledToken


@dataclass
class RequestOutput:
    """What one step added to one choice of a request."""
    index: int                 # which choice (parallel sample or beam) of the request
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.seqs: dict[int, Sequence] = {}          # every sequence of the request, by seq id
        self.detoks: dict[int, IncrementalDetokenizer] = {}   # by sample index
        self.beam: BeamSearch | None = None
        self.finished = False
        self.end_reason: str | None = None           # how it ended: stop, length, abort, timeout, error
        self.deadline: float | None = None           # time.monotonic() past which it is aborted
        self.replica = 0                             # which engine serves it (control_plane/router.py)
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        # per prompt position, (logprob, rank, top alternatives) once the data plane computed it; position 0
        # has none (control_plane/prompt_scoring.py records them)
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * len(prompt_ids)

    @property
    def buffered(self) -> bool:
        """Outputs are chosen at the end (best_of > n, beams) rather than streamed token by token."""
        return self.beam is not None or self.params.best_of > self.params.n

    def add_seq(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        if self.beam is None and seq.sample_index not in self.detoks:
            self.detoks[seq.sample_index] = IncrementalDetokenizer(
                self.tokenizer, self.prompt_ids, self.params.stop, self.params.include_stop_str_in_output,
                self.params.skip_special_tokens)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs.values() if not s.is_finished]

    def emit(self, out: RequestOutput) -> None:
        self.queue.put_nowait(out)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()
