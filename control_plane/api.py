"""OpenAI-compatible REST API over the engine (aiohttp)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control_plane import __version__, chat, generation_defaults, kv_blocks, page, tools
from control_plane.access import RETRY_AFTER_SECONDS, error_response, require_api_key, unavailable
from control_plane.api_schema import check_fields
from control_plane.endpoints import REQUEST_ID_HEADER, REQUEST_ID_KEY, ModelEndpoints, not_found, request_ids, system_fingerprint
from control_plane.engine import SHUTDOWN_MESSAGE, Engine
from control_plane.http_guard import BodyTimeout, read_body
from control_plane.openapi import openapi_spec
from control_plane.request import Request, RequestOutput
from control_plane.echo import echo_only
from control_plane.logprobs_json import generated as logprobs_of
from control_plane.prompt_scoring import Scoring, parse as parse_scoring
from control_plane.extension_params import apply_extensions, truncate_prompt_tokens
from control_plane.structured import parse_constraint
from control_plane.request_options import StreamUsage, drop_nulls, stream_usage
from control_plane.sampling_params import SamplingParams, ValidationError, flag, parse_sampling, parse_timeout

log = logging.getLogger("pagedserve.control_plane")
MAX_BODY_BYTES = 4 * 1024 * 1024
ENGINE_KEY = web.AppKey("engine", Engine)


def _validation_response(exc: ValidationError) -> web.Response:
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _number_of(text: str):
    """JSON has one number type, and JSON Schema counts 2.0 as an integer: an integral number is an int."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _strict_loads(text: str):
    """json.loads without NaN and Infinity, which are not JSON and would slip past range checks."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_number_of)


def _check_text(value, where: str = "the body") -> None:
    """JSON's \\ud800 escapes give strings that are not Unicode text (lone surrogates): no tokenizer
    can take them, so they are refused here, wherever they are in the body."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError(f"{where} holds a lone surrogate (\\ud800-\\udfff), which is not text",
                                  where if where != "the body" else None, "invalid_value") from None
    elif isinstance(value, list):
        for item in value:
            _check_text(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, key if where == "the body" and isinstance(key, str) else where)


async def _read_json(request: web.Request) -> dict:
    raw = await read_body(request)   # within the body read timeout
    try:
        body = _strict_loads(raw.decode(request.charset or "utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, LookupError) as exc:   # JSONDecodeError is a ValueError
        raise ValidationError(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ValidationError("the body must be a JSON object", None, "invalid_type")
    _check_text(body)
    return body


def _check_model(engine: Engine, body: dict) -> None:
    model = body.get("model")
    if model is not None and model not in engine.config.model_names:   # OpenAI's answer: 404 model_not_found
        raise ValidationError(f"The model '{model}' does not exist; this server serves "
                              f"'{engine.config.model_name}'", "model", "model_not_found", status=404)


def _parse_prompts(engine: Engine, prompt) -> list[list[int]]:
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


def _chat_prompt(engine: Engine, body: dict) -> list[int]:
    messages = chat.normalize_messages(body.get("messages"))
    return chat.render(engine.tokenizer, messages, body.get("tools"), chat.template_options(body))


def _usage(requests: list[Request], finals: list[RequestOutput]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every returned choice."""
    prompt = sum(len(r.prompt_ids) for r in requests)
    completion = sum(o.num_output_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Api:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._openapi = openapi_spec(engine.config.max_n, engine.config.model_name, engine.hs.vocab_size)
        self._fingerprint = system_fingerprint(engine.config.model_name)
        self._sampling_defaults = generation_defaults.for_config(engine.config)   # --generation-config

    def _start(self, prompts: list[list[int]], params: SamplingParams, timeout: float | None) -> list[Request]:
        request_id = uuid.uuid4().hex
        # validate every prompt before any is queued: a bad one must not leave the others running
        for ids in prompts:
            self.engine.validate_request(ids, params)
        return [self.engine.add_request(f"{request_id}-{i}", ids, params, timeout) for i, ids in enumerate(prompts)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await _read_json(request)
            check_fields(body, chat)
            body = drop_nulls(body)   # an optional field sent as null means the same as leaving it out
            _check_model(engine, body)
            prompts = [_chat_prompt(engine, body)] if chat else _parse_prompts(engine, body.get("prompt"))
            score_only = not chat and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
            params = parse_sampling({**body, "max_tokens": 1} if score_only else body,
                                    default_max_tokens=engine.hs.max_model_len if chat else 16,
                                    max_n=engine.config.max_n, chat=chat, defaults=self._sampling_defaults)
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
            usage_mode = stream_usage(body) if stream else None
            if stream and (params.use_beam_search or params.best_of > params.n):
                raise ValidationError("streaming is not available with beam search or best_of > n: the "
                                      "returned choices are known only at the end", "stream", "unsupported")
            return_ids = flag(body, "return_token_ids")
            if engine.draining:
                return unavailable("the server is shutting down", code="shutting_down")
            if not engine.data_plane_alive:
                return unavailable("the data plane is not available")
            if len(prompts) > engine.config.max_waiting:   # never accepted, however long it waits: not a 503
                raise ValidationError(f"'prompt' holds {len(prompts)} prompts; this server queues at most "
                                      f"{engine.config.max_waiting} requests (its --max-waiting): send at most "
                                      f"{engine.config.max_waiting} per request", "prompt", "too_many_prompts")
            if engine.num_waiting() + len(prompts) > engine.config.max_waiting:
                return unavailable(f"the server is overloaded: {engine.num_waiting()} requests are "
                                   "waiting already", code="overloaded")
            if scoring.text_only:
                for ids in prompts:
                    engine.validate_request(ids, params)
            else:
                requests = self._start(prompts, params, timeout)
        except ValidationError as exc:
            return _validation_response(exc)
        if scoring.text_only:
            return web.json_response(echo_only(prompts, engine.tokenizer, engine.config.model_name, return_ids))
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": engine.config.model_name, "system_fingerprint": self._fingerprint}
        try:
            if stream:
                return await self._stream(request, requests, meta, chat, return_ids, usage_mode, scoring, tool_mode)
            return await self._collect(requests, meta, chat, return_ids, scoring, tool_mode)
        finally:
            for r in requests:
                if not r.finished:
                    log.debug("request %s ended before it finished (the client went away); aborted", r.request_id)
                engine.abort(r)  # no-op for finished ones; a vanished client frees its blocks

    async def _collect(self, requests: list[Request], meta, chat, return_ids, scoring: Scoring,
                       tool_mode=None) -> web.Response:
        async def drain(req: Request) -> dict[int, list[RequestOutput]]:
            by_index: dict[int, list[RequestOutput]] = {}
            async for out in req:
                if out.index >= 0:
                    by_index.setdefault(out.index, []).append(out)
            return by_index
        results = await asyncio.gather(*(drain(r) for r in requests))
        for r in requests:
            if r.end_reason == "timeout":
                done = sum(s.num_output_tokens for s in r.seqs.values())
                return error_response(504, f"the request did not finish within its deadline ({done} tokens "
                                      "generated); send a larger 'timeout', lower max_tokens, or retry when "
                                      "the server is less busy", "timeout_error", "timeout", "request_timeout")
            if r.end_reason == "abort" and self.engine.draining:
                return unavailable(SHUTDOWN_MESSAGE, code="shutting_down")
        choices, finals = [], []
        n = requests[0].params.n
        for prompt_index, by_index in enumerate(results):
            for index in sorted(by_index):
                outputs = by_index[index]
                final = outputs[-1]
                if final.finish_reason == "error":
                    return error_response(500, final.error or "generation failed", "server_error")
                finals.append(final)
                text = "".join(o.text for o in outputs)
                choice = {"index": prompt_index * n + index, "finish_reason": final.finish_reason}
                if return_ids:
                    choice["token_ids"] = [t for o in outputs for t in o.token_ids]
                if chat:
                    choice["logprobs"] = logprobs_of(outputs, self.engine.tokenizer, True)
                    choice["message"] = {"role": "assistant", "content": text}
                    if tool_mode is not None:
                        content, calls = tools.parse_output(tool_mode, text)
                        choice["message"]["content"] = content
                        if calls:
                            choice["message"]["tool_calls"] = calls
                            choice["finish_reason"] = "tool_calls"
                else:
                    scoring.fill_choice(choice, requests[prompt_index], outputs, text)
                choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        answer = {**meta, "object": obj, "choices": choices,
                  "usage": _usage(requests, [] if scoring.score_only else finals)}
        if chat and scoring.vllm_k is not None:   # vLLM puts a chat's prompt log-probs beside its choices
            answer["prompt_logprobs"] = scoring.vllm_prompt(requests[0])
        return web.json_response(answer)

    async def _stream(self, request, requests: list[Request], meta, chat, return_ids,
                      usage_mode: StreamUsage, scoring: Scoring, tool_mode=None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: request[REQUEST_ID_KEY]})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        n = requests[0].params.n
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_index: int, req: Request):
            async for out in req:
                if out.index >= 0:
                    await merged.put((prompt_index * n + out.index, out))
            await merged.put((prompt_index, None))   # this request ended

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        finals: dict[int, RequestOutput] = {}

        generated = [0]   # completion tokens streamed so far, for continuous usage stats
        held: dict[int, str] = {}   # with tools: each choice's text until it finishes

        async def send(payload):
            if usage_mode.continuous and payload["choices"]:
                prompt = sum(len(r.prompt_ids) for r in requests)
                payload["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated[0],
                                    "total_tokens": prompt + generated[0]}
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        try:
            num_choices = len(requests) * n
            if chat:
                for i in range(num_choices):
                    await send({**meta, "object": obj, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            else:   # echo: the prompt comes first, once per choice (now, unless it waits for its log-probs)
                for i in range(num_choices):
                    opening = scoring.opening(i, requests[i // n])
                    if opening is not None:
                        await send({**meta, "object": obj, "choices": [opening]})
            num_ended = 0
            while len(finals) < num_choices and num_ended < len(requests):
                index, out = await merged.get()
                if out is None:
                    num_ended += 1
                    continue
                if out.finished:
                    finals[index] = out
                generated[0] += 0 if scoring.score_only else len(out.token_ids)
                choice = {"index": index, "finish_reason": out.finish_reason}
                if return_ids:
                    choice["token_ids"] = out.token_ids
                if chat:
                    choice["logprobs"] = logprobs_of([out], self.engine.tokenizer, True)
                    choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
                    if tool_mode is not None:
                        # tool calls are known only when the text is whole: held back, then sent as one delta
                        held[index] = held.get(index, "") + out.text
                        if not out.finished:
                            continue
                        content, calls = tools.parse_output(tool_mode, held[index])
                        choice["delta"] = {"content": content} if content else {}
                        if calls:
                            choice["delta"]["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                            choice["finish_reason"] = "tool_calls"
                if out.error:
                    choice["error"] = out.error
                for part in [choice] if chat else scoring.stream_choices(index, requests[index // n], out, choice):
                    await send({**meta, "object": obj, "choices": [part]})
            for index in range(num_choices):
                if index not in finals:   # ended before this choice began (a deadline, a shutdown)
                    req = requests[index // n]
                    finals[index] = RequestOutput(index, "", [], [], True, req.end_reason)
                    await send({**meta, "object": obj, "choices": [
                        {"index": index, "finish_reason": req.end_reason, "logprobs": None,
                         **({"delta": {}} if chat else {"text": ""})}]})
            if usage_mode.final:
                await send({**meta, "object": obj, "choices": [],
                            "usage": _usage(requests, [] if scoring.score_only else list(finals.values()))})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            for t in tasks:
                t.cancel()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        status = ("shutting down" if self.engine.draining else
                  "data plane down" if not self.engine.data_plane_alive else None)
        if status is not None:   # a probe or a load balancer may come back after Retry-After
            return web.json_response({"status": status}, status=503,
                                     headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        # replicas (control_plane/router.py): "degraded" while some are down, still a 200: it serves
        replicas = getattr(self.engine, "health", None)
        return web.json_response(replicas() if replicas is not None else {"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        hs = self.engine.hs
        return web.json_response({"version": __version__, "model": self.engine.config.model_name,
                                  "device": hs.device, "dtype": hs.dtype, "block_size": hs.block_size,
                                  "num_device_blocks": hs.num_device_blocks, "num_cpu_blocks": hs.num_cpu_blocks,
                                  "kv_block_bytes": self.engine.kv_block_bytes,
                                  "preemption_mode": self.engine.config.preemption_mode})

    async def debug_kv(self, request: web.Request) -> web.Response:
        """Block accounting for operators and stress tests: blocks in use and the integrity check."""
        return web.json_response(self.engine.kv_report())

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    async def metrics(self, request: web.Request) -> web.Response:
        self.engine.refresh_gauges()
        data = generate_latest(self.engine.stats.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error leaves as an OpenAI-style JSON body, never aiohttp's text/plain 500."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"the body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    except web.HTTPNotFound:
        return not_found(request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            resp = error_response(exc.status, exc.reason, code=str(exc.status))
            if isinstance(exc, web.HTTPMethodNotAllowed):   # RFC 9110: a 405 names the methods the route takes
                resp.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return resp
        raise
    except BodyTimeout as exc:
        return error_response(408, str(exc), code="body_timeout")
    except ConnectionError as exc:
        if request.transport is None or request.transport.is_closing():
            # the client went away (before or while we answered): its request was aborted, nothing to report
            log.debug("client %s went away during %s %s: %s", request.remote, request.method, request.path, exc)
            return web.Response(status=499)
        log.exception("connection error while serving %s %s", request.method, request.path)
        return error_response(500, "internal error; see the server log", "server_error", code="internal_error")
    except Exception:
        log.exception("error while serving %s %s", request.method, request.path)
        return error_response(500, "internal error; see the server log", "server_error", code="internal_error")


def make_app(engine: Engine) -> web.Application:
    api = Api(engine)
    middlewares = [request_ids, json_errors]
    if engine.config.api_key:
        middlewares.append(require_api_key(engine.config.api_key, page.is_public if engine.config.ui else None))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    ModelEndpoints(engine, _read_json).add_routes(app)
    app.router.add_get("/health", api.health)
    app.router.add_get("/version", api.version)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/debug/kv", api.debug_kv)
    app.router.add_get("/debug/kv/blocks", kv_blocks.handler(engine))
    if engine.config.ui:
        page.add_routes(app, key_required=bool(engine.config.api_key))
    app.router.add_get("/openapi.json", api.openapi)
    return app
