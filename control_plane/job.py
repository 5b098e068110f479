"""A generation request's body parsed once into one value, `Job`: its prompts as token ids, its
sampling, whether it streams, its usage and scoring options, its tools and its deadline.

Every check of the body happens here, the engine's own included (`Engine.validate_request`: the prompt
against the vocabulary and the context, a grammar compiled), so that a bad prompt among several is
found before any is queued. Admission (`Engine.admit`, or the router's) then takes the job as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from control_plane import chat as chat_template
from control_plane import tools
from control_plane.api_schema import check_fields
from control_plane.extension_params import apply_extensions, truncate_prompt_tokens
from control_plane.prompt_scoring import Scoring, parse as parse_scoring
from control_plane.request_options import StreamUsage, drop_nulls, stream_usage
from control_plane.sampling_params import SamplingParams, ValidationError, flag, parse_sampling, parse_timeout
from control_plane.serving import ServingEngine
from control_plane.structured import parse_constraint


@dataclass
class Job:
    chat: bool
    prompts: list[list[int]]        # one request each
    params: SamplingParams
    stream: bool
    usage_mode: StreamUsage | None  # streaming: when usage is sent
    scoring: Scoring                # echo, prompt log-probs, scoring the prompt alone
    tool_mode: object | None        # chat with tools: how the output's tool calls are read
    timeout: float | None           # seconds to this request's deadline
    return_ids: bool


def parse_request(engine: ServingEngine, body, chat: bool, defaults: dict) -> Job:
    """The job of a completions (`chat` False) or chat completions body; ValidationError names what is
    wrong. `engine`: the engine or router that will serve it; `defaults`: the sampling defaults of
    --generation-config."""
    check_fields(body, chat)
    body = drop_nulls(body)   # an optional field sent as null means the same as leaving it out
    _check_model(engine, body)
    prompts = [_chat_prompt(engine, body)] if chat else _parse_prompts(engine, body.get("prompt"))
    score_only = not chat and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
    params = parse_sampling({**body, "max_tokens": 1} if score_only else body,
                            default_max_tokens=engine.hs.max_model_len if chat else 16,
                            max_n=engine.config.max_n, chat=chat, defaults=defaults)
    apply_extensions(body, params, engine.tokenizer, engine.hs.vocab_size)
    tool_mode = tools.parse_tool_choice(body) if chat else None
    params.constraint = tools.forced_constraint(tool_mode) or parse_constraint(body)
    if params.constraint is not None and params.use_beam_search:
        raise ValidationError("structured output is not available with beam search", "use_beam_search",
                              "unsupported")
    keep = truncate_prompt_tokens(body)
    if keep is not None:
        prompts = [ids[-keep:] for ids in prompts]
    stream = flag(body, "stream")
    scoring = parse_scoring(body, params, chat, score_only, stream, engine.tokenizer)
    timeout = parse_timeout(body, engine.config.request_timeout)
    if chat and "max_tokens" not in body and "max_completion_tokens" not in body:
        params.max_tokens = max(1, engine.hs.max_model_len - len(prompts[0]))
        params.max_tokens = min(params.max_tokens, engine.pool_capacity_tokens - len(prompts[0]))
    if stream and (params.use_beam_search or params.best_of > params.n):
        raise ValidationError("streaming is not available with beam search or best_of > n: the "
                              "returned choices are known only at the end", "stream", "unsupported")
    if len(prompts) > engine.config.max_waiting:   # never accepted, however long it waits: not a 503
        raise ValidationError(f"'prompt' holds {len(prompts)} prompts; this server queues at most "
                              f"{engine.config.max_waiting} requests (its --max-waiting): send at most "
                              f"{engine.config.max_waiting} per request", "prompt", "too_many_prompts")
    # every prompt before any is queued: a bad one must not leave the others running
    for ids in prompts:
        engine.validate_request(ids, params)
    return Job(chat, prompts, params, stream, stream_usage(body) if stream else None, scoring, tool_mode, timeout,
               flag(body, "return_token_ids"))


def _check_model(engine, body: dict) -> None:
    model = body.get("model")
    if model is not None and model not in engine.config.model_names:   # OpenAI's answer: 404 model_not_found
        raise ValidationError(f"The model '{model}' does not exist; this server serves "
                              f"'{engine.config.model_name}'", "model", "model_not_found", status=404)


def _parse_prompts(engine, prompt) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    def is_ids(x):
        return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(prompt, str):
        items = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise ValidationError("'prompt' must be a non-empty string, list of strings, list of token ids, "
                              "or list of token-id lists", "prompt", "invalid_type")
    prompts = []
    for item in items:
        ids = item if isinstance(item, list) else engine.tokenizer.encode(item, add_special_tokens=False)
        if not ids:
            raise ValidationError("'prompt' must not be empty", "prompt")
        prompts.append(ids)
    return prompts


def _chat_prompt(engine, body: dict) -> list[int]:
    messages = chat_template.normalize_messages(body.get("messages"))
    return chat_template.render(engine.tokenizer, messages, body.get("tools"), chat_template.template_options(body))
