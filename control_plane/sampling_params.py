"""Sampling parameters of a request, validated from an OpenAI-style body."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import SamplingSpec


class ValidationError(ValueError):
    """Bad input: becomes HTTP 400 with the offending parameter named."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


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
    n: int = 1

    def spec(self, eos_token_ids: list[int]) -> SamplingSpec:
        """What the data plane's sampler needs; eos ids join the stop ids unless ignore_eos."""
        stop_ids = list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_token_ids))
        return SamplingSpec(self.temperature, self.top_k, self.top_p, self.min_p, self.seed,
                            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                            self.min_tokens, stop_ids, self.logprobs or 0)


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValidationError(f"'{name}' must be {'a number' if kind is float else 'an integer'}", name, "invalid_type")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValidationError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ValidationError(f"'{name}' must be <= {hi}, got {value}", name)
    return kind(value)


def parse_sampling(body: dict, default_max_tokens: int = 16, max_n: int = 16, chat: bool = False) -> SamplingParams:
    max_tokens_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    p = SamplingParams()
    p.max_tokens = _number(body, max_tokens_key, default_max_tokens, int, lo=1)
    p.temperature = _number(body, "temperature", 1.0, float, lo=0.0, hi=2.0)
    p.top_p = _number(body, "top_p", 1.0, float, lo=0.0, hi=1.0, lo_open=True)
    p.top_k = _number(body, "top_k", -1, int, lo=-1)
    p.min_p = _number(body, "min_p", 0.0, float, lo=0.0, hi=1.0)
    seed = body.get("seed")
    if seed is not None:
        p.seed = _number(body, "seed", None, int, lo=0, hi=2**63 - 1)
    p.presence_penalty = _number(body, "presence_penalty", 0.0, float, lo=-2.0, hi=2.0)
    p.frequency_penalty = _number(body, "frequency_penalty", 0.0, float, lo=-2.0, hi=2.0)
    p.repetition_penalty = _number(body, "repetition_penalty", 1.0, float, lo=0.0, lo_open=True)
    p.min_tokens = _number(body, "min_tokens", 0, int, lo=0)
    if p.min_tokens > p.max_tokens:
        raise ValidationError(f"'min_tokens' ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
                              "min_tokens")
    p.n = _number(body, "n", 1, int, lo=1, hi=max_n)
    if p.n != 1:
        raise ValidationError("'n' > 1 is not supported yet", "n", "unsupported")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValidationError("'ignore_eos' must be a boolean", "ignore_eos", "invalid_type")
    p.ignore_eos = ignore_eos
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ValidationError("'stop' must be a non-empty string or a list of up to 16 of them", "stop", "invalid_type")
    p.stop = stop
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise ValidationError("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids",
                              "invalid_type")
    p.stop_token_ids = stop_ids
    p.logprobs = _parse_logprobs(body, chat)
    return p


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = body.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise ValidationError("'logprobs' must be a boolean", "logprobs", "invalid_type")
        return _number(body, "top_logprobs", 0, int, lo=0, hi=20) if wanted else None
    if body.get("logprobs") is None:
        return None
    return _number(body, "logprobs", 0, int, lo=0, hi=20)
