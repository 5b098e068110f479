"""Sampling parameters of a request, validated from an OpenAI-style body.

Every number of a body passes `_number`: one place that refuses non-finite floats (JSON's 1e400
parses to inf) and integers beyond what msgpack's 64-bit ints and the engine's arithmetic carry.
Each field also has its own range, chosen so that the sampler and the beam scores stay finite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.protocol import SamplingSpec, draw_seed

# limits of a request body; control_plane.api_schema publishes the same numbers
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


INT64_MAX = 2**63 - 1   # msgpack carries at most a signed 64-bit int (seed: the wire's largest)
INT32_MAX = 2**31 - 1   # counts and token ids: far above any vocabulary or context
GREEDY_TEMPERATURE = 1e-5   # below this, logits / temperature overflows float32: sample greedily
MAX_LENGTH_PENALTY = 10.0   # length ** 10 stays finite in float64 for any context length
MAX_REPETITION_PENALTY = 100.0   # logits * 100 stay far inside float32
MIN_REPETITION_PENALTY = 0.01    # logits / 0.01 likewise
MAX_STOP_TOKEN_IDS = 1024   # the sampler bans them row by row; beams ask for (1 + this) * width candidates


class ValidationError(ValueError):
    """Bad input: becomes HTTP 400 (or `status`) with the offending parameter named."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: not asked; k: the chosen token's and k alternatives
    n: int = 1                   # choices returned
    best_of: int = 1             # sequences generated (>= n); with beam search, the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam scores are divided by (generated length ** length_penalty)
    early_stopping: bool | str = False  # beam search: True, False or "never", as in transformers
    priority: int = 0            # lower runs first and is preempted last (as in vLLM)
    # logits adjustments and text options (control_plane.extension_params parses them)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint: object = None    # structured output: a control_plane.structured.Constraint, or None
    prompt_logprobs: int | None = None   # None: not asked; k: each prompt token's log-prob and k alternatives

    def __post_init__(self):
        self.best_of = max(self.best_of, self.n)

    @property
    def beam_width(self) -> int:
        return self.best_of if self.use_beam_search else 0

    def stop_ids(self, eos_token_ids: list[int]) -> list[int]:
        """Token ids that end a sequence: eos ids join the stop ids unless ignore_eos."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_token_ids))

    def _spec_logprobs(self) -> int:
        """The data plane's logprobs: the alternatives asked for; -1 where no token's log-prob is used
        (not asked for, and no best_of ranking by the sum of them)."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.best_of > self.n else -1

    def spec(self, eos_token_ids: list[int], draw: int = 0) -> SamplingSpec:
        """What the data plane's sampler needs for the draw-th sample of this request."""
        stop_ids = self.stop_ids(eos_token_ids)
        if self.use_beam_search:
            # the data plane returns every beam's best (1 + stop ids) * width continuations
            k = max(2, 1 + len(stop_ids)) * self.best_of
            return SamplingSpec(temperature=0.0, stop_token_ids=stop_ids, logprobs=k, beam_width=self.best_of)
        first_draws = self.best_of if draw == 0 else 1
        return SamplingSpec(self.temperature, self.top_k, self.top_p, self.min_p, draw_seed(self.seed, draw),
                            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                            self.min_tokens, stop_ids, self._spec_logprobs(), first_draws, 0,
                            list(self.logit_bias), list(self.allowed_token_ids), list(self.bad_words_ids),
                            # the first sample computes the prompt; the others fork after it
                            self.prompt_logprobs if draw == 0 else None)


def check_for_model(params: SamplingParams, vocab_size: int, eos_token_ids: list[int]) -> None:
    """What only the model's facts can check, before the request is queued: token ids inside the
    vocabulary, and a beam's candidate count (the data plane's top-k) no larger than it."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValidationError(f"'stop_token_ids' outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                              "stop_token_ids", "invalid_token_id")
    if params.use_beam_search:
        k = params.spec(eos_token_ids).logprobs
        if k > vocab_size:
            raise ValidationError(
                f"beam search of width {params.best_of} with {len(params.stop_ids(eos_token_ids))} stop token ids "
                f"needs {k} candidates per beam, more than the vocabulary of {vocab_size}; use fewer stop "
                "token ids or a narrower beam", "stop_token_ids")


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
    """The one check of a numeric field: its type, finite, within 64-bit range, then [lo, hi]."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValidationError(f"'{name}' must be {'a number' if kind is float else 'an integer'}", name, "invalid_type")
    if kind is float and isinstance(value, int):   # JSON's 1e308 arrives as an int: a number field takes it
        try:
            value = float(value)
        except OverflowError:
            raise ValidationError(f"'{name}' must be a finite number", name) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError(f"'{name}' must be a finite number", name)
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValidationError(f"'{name}' is out of the 64-bit integer range", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValidationError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ValidationError(f"'{name}' must be <= {hi}, got {value}", name)
    return kind(value)


def flag(body: dict, name: str) -> bool:
    """A boolean field; absent or null means false."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValidationError(f"'{name}' must be true or false", name, "invalid_type")
    return value


def parse_sampling(body: dict, default_max_tokens: int = 16, max_n: int = 16, chat: bool = False,
                   defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's values of temperature, top_p, top_k, min_p and repetition_penalty for a
    request that leaves them out (control_plane.generation_defaults)."""
    d = defaults or {}
    max_tokens_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    p = SamplingParams()
    p.max_tokens = _number(body, max_tokens_key, default_max_tokens, int, lo=1, hi=INT32_MAX)
    p.temperature = _number(body, "temperature", d.get("temperature", 1.0), float, lo=0.0, hi=2.0)
    if p.temperature < GREEDY_TEMPERATURE:
        p.temperature = 0.0   # 1e-308 would divide the logits into inf and NaN: it means greedy
    p.top_p = _number(body, "top_p", d.get("top_p", 1.0), float, lo=0.0, hi=1.0, lo_open=True)
    p.top_k = _number(body, "top_k", d.get("top_k", -1), int, lo=-1, hi=INT32_MAX)
    p.min_p = _number(body, "min_p", d.get("min_p", 0.0), float, lo=0.0, hi=1.0)
    seed = body.get("seed")
    if seed is not None:
        p.seed = _number(body, "seed", None, int, lo=0, hi=2**63 - 1)
    p.presence_penalty = _number(body, "presence_penalty", 0.0, float, lo=-2.0, hi=2.0)
    p.frequency_penalty = _number(body, "frequency_penalty", 0.0, float, lo=-2.0, hi=2.0)
    p.repetition_penalty = _number(body, "repetition_penalty", d.get("repetition_penalty", 1.0), float, lo=MIN_REPETITION_PENALTY,
                                   hi=MAX_REPETITION_PENALTY)
    p.min_tokens = _number(body, "min_tokens", 0, int, lo=0, hi=INT32_MAX)
    p.priority = _number(body, "priority", 0, int, lo=-(2**31), hi=2**31 - 1)
    if p.min_tokens > p.max_tokens:
        raise ValidationError(f"'min_tokens' ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
                              "min_tokens")
    p.n = _number(body, "n", 1, int, lo=1, hi=INT32_MAX)
    p.best_of = _number(body, "best_of", p.n, int, lo=1, hi=INT32_MAX)
    for name, value in (("n", p.n), ("best_of", p.best_of)):
        if value > max_n:
            raise ValidationError(f"'{name}' is {value}, over this server's limit of {max_n} sequences per "
                                  f"request (its --max-n); ask for at most {max_n}", name)
    if p.best_of < p.n:
        raise ValidationError(f"'best_of' ({p.best_of}) must be at least n ({p.n})", "best_of")
    p.use_beam_search = flag(body, "use_beam_search")
    p.length_penalty = _number(body, "length_penalty", 1.0, float, lo=-MAX_LENGTH_PENALTY, hi=MAX_LENGTH_PENALTY)
    early = body.get("early_stopping")
    early = False if early is None else early
    if not (isinstance(early, bool) or early == "never"):
        raise ValidationError("'early_stopping' must be true, false or \"never\"", "early_stopping")
    p.early_stopping = early
    if p.use_beam_search and p.best_of < 2:
        raise ValidationError("beam search needs a width ('best_of' or 'n') of at least 2", "best_of")
    p.ignore_eos = flag(body, "ignore_eos")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ValidationError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
                              "stop", "invalid_type")
    p.stop = stop
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise ValidationError("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids",
                              "invalid_type")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(f"'stop_token_ids' has {len(stop_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                              "accepted", "stop_token_ids")
    if any(t > INT32_MAX for t in stop_ids):   # beyond any vocabulary (checked against it at admission)
        raise ValidationError("'stop_token_ids' holds an id beyond any vocabulary", "stop_token_ids",
                              "invalid_token_id")
    p.stop_token_ids = stop_ids
    p.logprobs = _parse_logprobs(body, chat)
    return p


def parse_timeout(body: dict, server_timeout: float | None) -> float | None:
    """Seconds the request may take: the body's `timeout`, capped by the server's --request-timeout."""
    timeout = _number(body, "timeout", None, float, lo=0.0, lo_open=True)
    if timeout is None:
        return server_timeout
    return timeout if server_timeout is None else min(timeout, server_timeout)


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = flag(body, "logprobs")
        return _number(body, "top_logprobs", 0, int, lo=0, hi=MAX_LOGPROBS) if wanted else None
    if body.get("logprobs") is None:
        return None
    return _number(body, "logprobs", 0, int, lo=0, hi=MAX_LOGPROBS)
