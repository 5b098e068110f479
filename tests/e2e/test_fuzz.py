"""Fuzzing the REST API from its own OpenAPI description (GET /openapi.json) with hypothesis, against
real processes (the CURVE-linked tiny-model server): bodies drawn from the request schemas, the
same with one field swapped for arbitrary JSON or with unknown fields added, arbitrary JSON
documents, and raw bytes. No answer may be a 5xx (except 504 for a body that set a deadline),
every error is an OpenAI-style error object, and the server serves a valid request afterwards
with every block free. PAGEDSERVE_FUZZ_EXAMPLES changes the number of examples (default 150)."""
import http.client
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.api_schema import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "150"))
ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}

# keep each example cheap: what the schema allows, within small bounds
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
any_json = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
OVERRIDES = {
    "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 3),
    "n": st.integers(1, 3), "best_of": st.integers(1, 4), "timeout": st.floats(0.001, 30),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.text(min_size=1, max_size=10), min_size=1,
                                                                   max_size=3),
                        st.lists(st.integers(0, 49151), min_size=1, max_size=12)),
}


def strategy(schema: dict, components: dict, name: str | None = None):
    """A hypothesis strategy for the subset of JSON Schema the API description uses."""
    if name in OVERRIDES:
        return OVERRIDES[name]
    if "$ref" in schema:
        return strategy(components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema:
        return st.one_of([strategy(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    types = schema.get("type", "object")
    types = types if isinstance(types, list) else [types]
    options = []
    for t in types:
        if t == "null":
            options.append(st.none())
        elif t == "boolean":
            options.append(st.booleans())
        elif t == "integer":
            options.append(st.integers(schema.get("minimum"), schema.get("maximum")))
        elif t == "number":
            lo = schema.get("minimum", schema.get("exclusiveMinimum"))
            options.append(st.floats(lo, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                                     exclude_min="exclusiveMinimum" in schema and lo is not None))
        elif t == "string":
            options.append(st.text(min_size=schema.get("minLength", 0), max_size=20))
        elif t == "array":
            options.append(st.lists(strategy(schema.get("items", {}), components), min_size=schema.get("minItems", 0),
                                    max_size=min(schema.get("maxItems", 4), 4)))
        elif t == "object" and "properties" in schema:
            props = schema["properties"]
            required = set(schema.get("required", []))
            options.append(st.fixed_dictionaries(
                {k: strategy(v, components, k) for k, v in props.items() if k in required},
                optional={k: strategy(v, components, k) for k, v in props.items() if k not in required}))
        else:
            options.append(st.dictionaries(st.text(max_size=8), any_json, max_size=3))
    return st.one_of(options)


def request(server, method: str, path: str, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check_answer(path: str, body, status: int, payload: bytes, known: set) -> None:
    sets_deadline = isinstance(body, dict) and isinstance(body.get("timeout"), (int, float))
    assert status < 500 or (status == 504 and sets_deadline), (path, body, status, payload[:500])
    if isinstance(body, dict) and body.get("stream") is True and status == 200:
        lines = [line for line in payload.decode().split("\n") if line]
        assert lines[-1] == "data: [DONE]", (body, payload[-300:])
        return
    data = json.loads(payload)
    if isinstance(body, dict) and set(body) - known:   # the field names are checked first
        assert status == 400 and data["error"]["code"] == "unknown_field", (body, data)
    if status >= 400:
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], data
    else:
        assert "usage" in data and data["choices"], data


def test_fuzzed_requests_never_get_a_5xx_and_the_server_survives(curve_split):
    server = curve_split
    status, doc = request(server, "GET", "/openapi.json")
    assert status == 200
    spec = json.loads(doc)
    components = spec["components"]["schemas"]
    assert set(ENDPOINTS) <= set(spec["paths"])
    valid = {path: strategy(components[ref], components) for path, ref in ENDPOINTS.items()}

    def garbled(path):
        return valid[path].flatmap(lambda body: st.one_of(
            # one known field with an arbitrary JSON value
            st.sampled_from(sorted(body) or ["prompt"]).flatmap(
                lambda key: any_json.map(lambda value: {**body, key: value})),
            # unknown fields added
            st.dictionaries(st.text(min_size=1, max_size=10), any_json, min_size=1, max_size=2).map(
                lambda extra: {**extra, **body})))

    bodies = st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda path: st.tuples(st.just(path), st.one_of(
        valid[path], valid[path], garbled(path), any_json)))
    raw_bytes = st.tuples(st.sampled_from(sorted(ENDPOINTS)), st.binary(max_size=64))
    statuses = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(bodies, bodies, bodies, raw_bytes))
    def run(case):
        path, body = case
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, payload = request(server, "POST", path, raw)
        statuses.append(status)
        known = set(components[ENDPOINTS[path]]["properties"]) | set(
            UNSUPPORTED_CHAT if "chat" in path else UNSUPPORTED_COMPLETION)
        check_answer(path, body, status, payload, known)

    started = time.monotonic()
    run()
    elapsed = time.monotonic() - started
    print(f"fuzz: {len(statuses)} requests in {elapsed:.1f}s; statuses {sorted(set(statuses))}")
    assert 200 in statuses and 400 in statuses   # it explored both sides
    assert server.proc.poll() is None and server.dp_proc.poll() is None
    status, payload = request(server, "POST", "/v1/completions",
                              json.dumps({"prompt": "Hello there", "max_tokens": 4}).encode())
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    while True:
        kv = json.loads(request(server, "GET", "/debug/kv")[1])
        if kv["device_blocks_used"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kv["device_blocks_used"] == 0 and kv["running"] == kv["waiting"] == 0 and kv["integrity"] == "ok", kv
    for log in (server.log_all(), server.dp_log()):
        assert "Traceback" not in log, log[-3000:]
