"""A request and its sequences as the control plane tracks them."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from control_plane.sampling_params import SamplingParams
from shared.protocol import SamplingSpec

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens. Tokens [0, num_computed_tokens) have their KV in the sequence's blocks."""
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    spec: SamplingSpec | None = None    # what the data plane samples with (per parallel sample)
    sample_index: int = 0               # which of the request's samples (or beams) this is
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    known_to_data_plane: bool = False   # sent in full once; afterwards only deltas
    num_tokens_sent: int = 0            # beams: tokens the data plane has (it appends no token itself)
    # overlap: tokens the data plane samples, and appends itself, in steps still in flight; the
    # control plane learns them with those steps' results (see Scheduler.commit)
    num_pending_tokens: int = 0
    finish_reason: str | None = None    # set when its end is decided (the scheduler frees it after)
    cumulative_logprob: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_expected_tokens(self) -> int:
        """Tokens known here plus those steps in flight will sample: what the next step plans for."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.spec is not None and self.spec.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
