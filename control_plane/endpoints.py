"""Endpoints around generation: the model list and one model, vLLM's /tokenize and /detokenize,
and the middleware that gives every answer an X-Request-Id and every unknown route an OpenAI 404."""
from __future__ import annotations

import hashlib
import time

from aiohttp import web

from control_plane import __version__, chat
from control_plane.access import error_response
from control_plane.request_options import drop_nulls, request_id
from control_plane.sampling_params import ValidationError, flag

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("request_id", str)


def system_fingerprint(model_name: str) -> str:
    """Stable for one build serving one model, as OpenAI's fingerprint is for one backend config."""
    return "fp_" + hashlib.sha256(f"pagedserve {__version__} {model_name}".encode()).hexdigest()[:10]


@web.middleware
async def request_ids(request: web.Request, handler):
    """Echoes the client's X-Request-Id (or makes one) on every answer, errors included."""
    rid = request_id(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_ID_KEY] = rid
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        exc.headers[REQUEST_ID_HEADER] = rid
        raise
    if not resp.prepared:          # a stream has sent its headers already (it sets the id itself)
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def not_found(request: web.Request) -> web.Response:
    return error_response(404, f"Invalid URL ({request.method} {request.path}): this server has no such route; "
                          "see GET /openapi.json", code="unknown_url")


class ModelEndpoints:
    def __init__(self, engine, read_json):
        self.engine = engine
        self.read_json = read_json   # the generation endpoints' body reader (strict JSON, an object)
        self.created = int(time.time())   # when this server started serving the model

    def _card(self) -> dict:
        e = self.engine
        return {"id": e.config.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": e.hs.model_id, "parent": None, "max_model_len": e.hs.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.engine.config.model_names:
            return error_response(404, f"The model '{name}' does not exist; this server serves "
                                  f"'{self.engine.config.model_name}'", param="model", code="model_not_found")
        return web.json_response(self._card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's shape: {prompt} or {messages}; answers {count, max_model_len, tokens[, token_strs]}."""
        try:
            body = drop_nulls(await self.read_json(request))
            tok = self.engine.tokenizer
            if "messages" in body:
                messages = chat.normalize_messages(body["messages"])
                options = chat.template_options({"add_generation_prompt": True, **body})
                ids = chat.render(tok, messages, body.get("tools"), options)
            elif isinstance(body.get("prompt"), str):
                special = body.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise ValidationError("'add_special_tokens' must be true or false", "add_special_tokens",
                                          "invalid_type")
                ids = tok.encode(body["prompt"], add_special_tokens=special)
            else:
                raise ValidationError("send a string 'prompt' or a list of chat 'messages'", "prompt",
                                      "invalid_type")
            answer = {"count": len(ids), "max_model_len": self.engine.hs.max_model_len, "tokens": ids}
            if flag(body, "return_token_strs"):
                answer["token_strs"] = tok.convert_ids_to_tokens(ids)
            return web.json_response(answer)
        except ValidationError as exc:
            return error_response(400, exc.message, param=exc.param, code=exc.code)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self.read_json(request)
            ids = body.get("tokens")
            vocab = self.engine.hs.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValidationError("'tokens' must be a list of token ids", "tokens", "invalid_type")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValidationError(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}", "tokens",
                                      "invalid_token_id")
            return web.json_response({"prompt": self.engine.tokenizer.decode(ids)})
        except ValidationError as exc:
            return error_response(400, exc.message, param=exc.param, code=exc.code)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
