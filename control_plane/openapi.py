"""The OpenAPI 3.1 description of the REST API, served at GET /openapi.json.

Built from one dict; the request bodies come from `api_schema`, whose field lists the server
also enforces. `python -m control_plane.openapi > docs/openapi.json` refreshes the copy in
docs/ (a test checks that it is current).
"""
from __future__ import annotations

import copy
import json
import sys

from control_plane import __version__
from control_plane.api_schema import chat_schema, completion_schema, detokenize_schema, tokenize_schema

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string", "description": "what went wrong and what to change"},
                   "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "properties": {k: {"type": "integer"} for k in
                                          ("prompt_tokens", "completion_tokens", "total_tokens")}}
FINISH_REASON = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "timeout", "error", None],
                 "description": "'timeout': the request's deadline passed (streams only; otherwise 504)"}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(ref: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _generation(summary: str, body_ref: str, response_ref: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": body_ref}}}},
        "responses": {
            "200": {"description": "the answer, or with stream: true server-sent events ending in "
                                   "'data: [DONE]'",
                    "content": {"application/json": {"schema": {"$ref": response_ref}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": _error("bad input: the message says what to fix"),
            "401": _error("missing or wrong API key (with --api-key)"),
            "404": _error("model_not_found: 'model' names another model than the one served"),
            "413": _error("the body is over 4 MiB"),
            "503": _error("overloaded, shutting down, or the data plane is restarting; see Retry-After"),
            "504": _error("the request's deadline (timeout, --request-timeout) passed"),
        }}}


# vLLM's shape: null for the first prompt token, then {token id: {logprob, rank, decoded_token}}
PROMPT_LOGPROBS = {"type": "array", "description": "with prompt_logprobs: k (the raw model distribution)",
                   "items": {"type": ["object", "null"], "additionalProperties": {"type": "object", "properties": {
                       "logprob": {"type": "number"}, "rank": {"type": "integer"},
                       "decoded_token": {"type": "string"}}}}}


def _bound_token_ids(schema: dict, vocab_size: int) -> dict:
    """`schema` with a maximum on every token id of the prompt, stop_token_ids and allowed_token_ids."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = vocab_size - 1
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    for name in ("prompt", "stop_token_ids", "allowed_token_ids"):
        if name in schema["properties"]:
            walk(schema["properties"][name])
    return schema


def openapi_spec(max_n: int = 16, model_name: str = "model", vocab_size: int | None = None) -> dict:
    """`vocab_size`: token ids above it are declared invalid (a live server knows it; docs/openapi.json does not)."""
    choice_common = {"index": {"type": "integer"}, "finish_reason": FINISH_REASON,
                     "logprobs": {"type": ["object", "null"]},
                     "token_ids": {"type": "array", "items": {"type": "integer"},
                                   "description": "with return_token_ids: true"}}
    completion = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            **choice_common, "text": {"type": "string"},
            "prompt_logprobs": PROMPT_LOGPROBS}}}}}
    chat = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE, "prompt_logprobs": PROMPT_LOGPROBS,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            **choice_common, "message": {"type": "object", "properties": {
                "role": {"const": "assistant"}, "content": {"type": "string"}}}}}}}}
    simple = {"type": "object"}

    def requests(schema):
        return _bound_token_ids(schema, vocab_size) if vocab_size else schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": __version__,
                 "description": f"OpenAI-compatible completions over PagedAttention, serving '{model_name}'. "
                                "Every endpoint but /health, /metrics and the page (/) needs 'Authorization: "
                                "Bearer KEY' when the server runs with --api-key."},
        "paths": {
            "/v1/completions": _generation("text completion", "#/components/schemas/CompletionRequest",
                                           "#/components/schemas/Completion"),
            "/v1/chat/completions": _generation("chat completion (the tokenizer's chat template)",
                                                "#/components/schemas/ChatCompletionRequest",
                                                "#/components/schemas/ChatCompletion"),
            "/v1/models": {"get": {"summary": "the served model", "responses": {"200": _json("models", simple)}}},
            "/v1/models/{model}": {"get": {"summary": "one model (404 for another name)", "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json("the model", simple), "404": _error("not served here")}}},
            "/tokenize": {"post": {"summary": "vLLM's tokenize: {prompt} or {messages} -> {tokens, count, "
                                              "max_model_len}", "requestBody": _body("#/components/schemas/TokenizeRequest"),
                                   "responses": {"200": _json("", simple), "400": _error("bad input")}}},
            "/detokenize": {"post": {"summary": "vLLM's detokenize: {tokens} -> {prompt}",
                                     "requestBody": _body("#/components/schemas/DetokenizeRequest"),
                                     "responses": {"200": _json("", simple), "400": _error("bad input")}}},
            "/health": {"get": {"summary": "200 when requests can be served", "responses": {
                "200": _json("ok; with replicas, 'degraded' while some are down (the others serve), with "
                             "replicas, replicas_up and replicas_down", simple),
                "503": _json("data plane down (every replica), or shutting down", simple)}}},
            "/version": {"get": {"summary": "version, device, pool sizes", "responses": {"200": _json("", simple)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/debug/kv": {"get": {"summary": "blocks in use, queues, block integrity",
                                  "responses": {"200": _json("", simple)}}},
            "/debug/kv/blocks": {"get": {"summary": "every KV block's state, holders and ref count, and each "
                                                    "sequence's block table, on the device and the CPU pool "
                                                    "(the page's block map; format: control_plane/kv_blocks.py)",
                                         "responses": {"200": _json("", simple)}}},
            "/": {"get": {"summary": "the built-in page: KV block map, charts, chat playground (off with "
                                     "--no-ui; needs no key, and asks for one)",
                          "responses": {"200": {"description": "HTML", "content": {"text/html": {
                              "schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {"200": _json("", simple)}}},
        },
        "components": {"schemas": {
            "CompletionRequest": requests(completion_schema(max_n)),
            "ChatCompletionRequest": requests(chat_schema(max_n)),
            "TokenizeRequest": tokenize_schema(), "DetokenizeRequest": detokenize_schema(vocab_size),
            "Completion": completion, "ChatCompletion": chat, "Error": ERROR}},
    }


if __name__ == "__main__":
    json.dump(openapi_spec(), sys.stdout, indent=1)
    sys.stdout.write("\n")
