"""The request bodies of the generation endpoints as JSON Schema, and the check of their field names.

One table serves two purposes: `control_plane.openapi` publishes it, and `check_fields` rejects
any field it does not name. Values are validated by `sampling_params.parse_sampling` and the
API handlers, which give the precise messages; the schema tells clients what those accept.

Three kinds of field:
- supported: OpenAI's fields that change the answer, and our extensions (vLLM-style);
- ignored: OpenAI fields that cannot change the answer (`user`, `store`, ...): accepted, type-checked;
- unsupported: OpenAI fields we do not implement (`logit_bias`, `tools`, ...): accepted only when
  they hold their neutral value (null, false, empty), else 400 with code `unsupported_parameter`.
Anything else is 400 with code `unknown_field`.
"""
from __future__ import annotations

from control_plane.extension_fields import (CHAT_EXTENSIONS, COMPLETION_EXTENSIONS, MESSAGE_PROPERTIES,
                                            STREAM_OPTIONS)
from control_plane.sampling_params import (INT32_MAX, MAX_LENGTH_PENALTY, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
                                          MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_REPETITION_PENALTY,
                                          ValidationError)


def _int(desc: str, minimum: int | None = None, maximum: int | None = None) -> dict:
    s = {"type": ["integer", "null"], "description": desc}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _num(desc: str, minimum: float | None = None, maximum: float | None = None, exclusive_min: bool = False) -> dict:
    s = {"type": ["number", "null"], "description": desc}
    if minimum is not None:
        s["exclusiveMinimum" if exclusive_min else "minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _bool(desc: str) -> dict:
    return {"type": ["boolean", "null"], "description": desc}


TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def sampling_properties(max_n: int) -> dict:
    """Fields both endpoints share."""
    return {
        "model": {"type": ["string", "null"], "description": "must name the served model when given"},
        "max_tokens": _int("tokens to generate at most; prompt + max_tokens must fit the context", 1, INT32_MAX),
        "temperature": _num("0 (or below 1e-5) is greedy", 0.0, 2.0),
        "top_p": _num("nucleus mass kept", 0.0, 1.0, exclusive_min=True),
        "n": _int(f"choices returned (at most {max_n}, the server's --max-n)", 1, max_n),
        "stop": {"description": f"up to {MAX_STOP_STRINGS} non-empty strings that end a choice",
                 "anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1},
                            "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "stream": _bool("server-sent events ending in 'data: [DONE]'"),
        "seed": _int("makes sampling reproducible whatever the batch", 0, 2**63 - 1),
        "presence_penalty": _num("", -2.0, 2.0),
        "frequency_penalty": _num("", -2.0, 2.0),
        # extensions (as in vLLM)
        "best_of": _int(f"sequences generated, the n most likely returned (at most {max_n}); the beam width "
                        "with use_beam_search", 1, max_n),
        "top_k": _int("-1: all tokens", -1, INT32_MAX),
        "min_p": _num("drop tokens below min_p * p(most likely)", 0.0, 1.0),
        "repetition_penalty": _num("HF-style, over prompt and output", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "min_tokens": _int("stop tokens are banned until this many are generated (<= max_tokens)", 0),
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                           "maxItems": MAX_STOP_TOKEN_IDS,
                           "description": "token ids that end a choice (each inside the vocabulary)"},
        "ignore_eos": _bool("go on past the end-of-sequence token"),
        "use_beam_search": _bool("beam search of width best_of (default n); not with stream"),
        "length_penalty": _num("beam scores are divided by length ** length_penalty", -MAX_LENGTH_PENALTY,
                               MAX_LENGTH_PENALTY),
        "early_stopping": {"description": "beam search: true, false or \"never\", as in transformers",
                           "anyOf": [{"type": ["boolean", "null"]}, {"const": "never"}]},
        "priority": _int("lower runs first and is preempted last", -(2**31), 2**31 - 1),
        "return_token_ids": _bool("add each choice's generated token ids"),
        "timeout": _num("seconds this request may take; past it, it is aborted (504, or a last stream "
                        "chunk with finish_reason 'timeout'); capped by the server's --request-timeout",
                        0.0, exclusive_min=True),
    }


def completion_schema(max_n: int = 16) -> dict:
    props = {
        "prompt": {"description": "a string, a list of strings, a list of token ids, or a list of such lists",
                   "anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                             TOKEN_IDS,
                             {"type": "array", "items": TOKEN_IDS, "minItems": 1}]},
        **sampling_properties(max_n),
        "logprobs": _int("log-probabilities of the chosen token and this many alternatives", 0, MAX_LOGPROBS),
    }
    props["max_tokens"] = _int("tokens to generate at most; prompt + max_tokens must fit the context; 0 scores "
                               "the prompt only (with echo or prompt_logprobs)", 0, INT32_MAX)
    props.update(IGNORED_PROPERTIES)
    props.update(COMPLETION_EXTENSIONS)
    return {"type": "object", "required": ["prompt"], "properties": props, "additionalProperties": False}


MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False,
           "properties": MESSAGE_PROPERTIES,
           # content, unless an assistant message calls tools; a tool message names the call it answers
           "anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                     {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                                 "tool_calls": {"type": "array", "minItems": 1}}}],
           "if": {"properties": {"role": {"const": "tool"}}},
           "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}}


def chat_schema(max_n: int = 16) -> dict:
    props = {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        **sampling_properties(max_n),
        "max_completion_tokens": _int("the same as max_tokens (and preferred to it)", 1, INT32_MAX),
        "logprobs": _bool("return log-probabilities of the chosen tokens"),
        "top_logprobs": _int("alternatives per token, with logprobs: true", 0, MAX_LOGPROBS),
    }
    props.update(IGNORED_PROPERTIES)
    props.update(CHAT_EXTENSIONS)
    return {"type": "object", "required": ["messages"], "properties": props, "additionalProperties": False,
            **CONTINUE_RULE}


# continue_final_message continues the last message, so the generation prompt (on by default) must be off
CONTINUE_RULE = {"if": {"required": ["continue_final_message"],
                        "properties": {"continue_final_message": {"const": True}}},
                 "then": {"required": ["add_generation_prompt"],
                          "properties": {"add_generation_prompt": {"const": False}}}}


def tokenize_schema() -> dict:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template (other fields are ignored)."""
    chat = chat_schema()["properties"]
    flag = {"type": ["boolean", "null"]}
    return {"anyOf": [
        {"type": "object", "required": ["prompt"], "properties": {
            "prompt": {"type": "string"}, "add_special_tokens": flag, "return_token_strs": flag}},
        {"type": "object", "required": ["messages"], "properties": {
            "messages": chat["messages"], "tools": chat["tools"], "return_token_strs": flag,
            **{k: chat[k] for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")}},
         **CONTINUE_RULE}]}


def detokenize_schema(vocab_size: int | None = None) -> dict:
    ids = {"type": "integer", "minimum": 0}
    if vocab_size:
        ids["maximum"] = vocab_size - 1
    return {"type": "object", "required": ["tokens"], "properties": {"tokens": {"type": "array", "items": ids}}}


# OpenAI fields that cannot change the answer: accepted and ignored (usage is always in the stream)
IGNORED_PROPERTIES = {
    "user": {"type": ["string", "null"], "description": "accepted and ignored"},
    "stream_options": STREAM_OPTIONS,
    "metadata": {"type": ["object", "null"], "description": "accepted and ignored"},
    "store": {"type": ["boolean", "null"], "description": "accepted and ignored"},
    "service_tier": {"type": ["string", "null"], "description": "accepted and ignored"},
    "parallel_tool_calls": {"type": ["boolean", "null"], "description": "accepted and ignored"},
}
_JSON_TYPES = {"string": str, "object": dict, "boolean": bool, "null": type(None)}

# OpenAI fields we do not implement: accepted only with one of these neutral values
UNSUPPORTED_COMPLETION = {"suffix": (None, "")}
UNSUPPORTED_CHAT = {
    "functions": (None, []),
    "function_call": (None, "none"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "verbosity": (None,),
}


def _neutral(value, allowed: tuple) -> bool:
    # `False == 0` in Python: compare types too, so that echo: 0 is not taken for echo: false
    return any(value == a and type(value) is type(a) for a in allowed)


def check_fields(body: dict, chat: bool) -> None:
    """Raises ValidationError for a field the API does not define, or an unsupported one in use."""
    known = _KNOWN_CHAT if chat else _KNOWN_COMPLETION
    unsupported = UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION
    unknown = sorted(k for k in body if k not in known and k not in unsupported)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValidationError(f"unknown field{'s' if len(unknown) > 1 else ''} {names}: remove "
                              f"{'them' if len(unknown) > 1 else 'it'} (see GET /openapi.json for the fields "
                              "this endpoint accepts)", unknown[0], "unknown_field")
    for name, allowed in unsupported.items():
        if name in body and not _neutral(body[name], allowed):
            raise ValidationError(f"'{name}' is not supported by this server; remove it or set it to "
                                  f"{_show(allowed[-1])}", name, "unsupported_parameter")
    for name, prop in IGNORED_PROPERTIES.items():
        if name in body and not isinstance(body[name], tuple(_JSON_TYPES[t] for t in prop["type"])):
            raise ValidationError(f"'{name}' must be {' or '.join(prop['type'])}", name, "invalid_type")
    if chat and isinstance(body.get("messages"), list):
        for i, message in enumerate(body["messages"]):
            extra = sorted(set(message) - set(MESSAGE["properties"])) if isinstance(message, dict) else []
            if extra:
                raise ValidationError(f"messages[{i}] has unknown field(s) {', '.join(map(repr, extra))}; a "
                                      f"message takes {', '.join(map(repr, MESSAGE['properties']))}", "messages",
                                      "unknown_field")


_KNOWN_COMPLETION = frozenset(completion_schema()["properties"])
_KNOWN_CHAT = frozenset(chat_schema()["properties"])


def _show(value) -> str:
    return {None: "null", False: "false"}.get(value, repr(value)) if not isinstance(value, (dict, list)) \
        else str(value).replace("'", '"')
