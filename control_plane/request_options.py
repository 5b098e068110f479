"""Request options that shape the response rather than the sampling: nulls, stream usage, request ids."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from control_plane.sampling_params import ValidationError

MAX_REQUEST_ID_CHARS = 256


def drop_nulls(body: dict) -> dict:
    """OpenAI's SDKs and LangChain send unset optional fields as null: null means absent, everywhere."""
    return {k: v for k, v in body.items() if v is not None}


@dataclass(frozen=True)
class StreamUsage:
    final: bool = False        # a last chunk with `choices: []` and the usage (include_usage)
    continuous: bool = False   # usage so far on every chunk (vLLM's continuous_usage_stats)


def stream_usage(body: dict) -> StreamUsage:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValidationError("'stream_options' must be an object", "stream_options", "invalid_type")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ValidationError(f"stream_options has unknown field(s) {', '.join(map(repr, unknown))}",
                              "stream_options", "unknown_field")
    values = {}
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise ValidationError(f"stream_options.{name} must be true or false", "stream_options", "invalid_type")
        values[name] = bool(value)
    return StreamUsage(values["include_usage"], values["continuous_usage_stats"])


def request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is printable and short, else a new one."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable():
        return given
    return uuid.uuid4().hex
