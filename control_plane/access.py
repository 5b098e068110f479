"""HTTP error bodies, API-key checks and overload answers shared by the REST handlers."""
from __future__ import annotations

import hmac

from aiohttp import web

PUBLIC_PATHS = frozenset({"/health", "/metrics"})   # probes and scrapers need no key
RETRY_AFTER_SECONDS = 5


def error_response(status: int, message: str, err_type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status)


def unavailable(message: str, code: str = "unavailable") -> web.Response:
    """503 with Retry-After: the request was not accepted, and may be sent again later."""
    resp = error_response(503, message, "service_unavailable", code=code)
    resp.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return resp


def require_api_key(api_key: str, also_public=None):
    """`also_public(path)`: more paths that need no key (the built-in page, which asks for it)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in PUBLIC_PATHS and not (also_public and also_public(request.path)):
            # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: turn them back
            # into the bytes sent (a wrong key, never a UnicodeEncodeError)
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):   # constant time: no timing oracle on the key
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                      "authentication_error", code="invalid_api_key")
        return await handler(request)
    return check
