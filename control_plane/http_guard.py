"""Read timeouts for the HTTP server, so that slow clients cannot hold connections (slowloris).

aiohttp's server waits for a request's headers without limit, and keeps an idle keep-alive
connection for an hour by default. Here:
- a connection must deliver complete request headers within HEADER_TIMEOUT of opening, or it
  is closed (a guard timer on aiohttp's request handler);
- an idle keep-alive connection is closed after KEEPALIVE_TIMEOUT (aiohttp's own setting);
- the body of a request must arrive within BODY_TIMEOUT (the API reads it through `read_body`,
  which answers 408 past it).
PAGEDSERVE_HEADER_TIMEOUT, PAGEDSERVE_BODY_TIMEOUT and PAGEDSERVE_KEEPALIVE_TIMEOUT (seconds)
change them.
"""
from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("pagedserve.control_plane")
HEADER_TIMEOUT = float(os.environ.get("PAGEDSERVE_HEADER_TIMEOUT", "10"))
BODY_TIMEOUT = float(os.environ.get("PAGEDSERVE_BODY_TIMEOUT", "30"))
KEEPALIVE_TIMEOUT = float(os.environ.get("PAGEDSERVE_KEEPALIVE_TIMEOUT", "30"))


class BodyTimeout(Exception):
    """The client did not send its body in time."""


async def read_body(request: web.Request) -> bytes:
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {BODY_TIMEOUT:.0f}s") from None


class _GuardedHandler(RequestHandler):
    """aiohttp's handler, closing a connection whose first request's headers do not arrive in time."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_guard = asyncio.get_running_loop().call_later(HEADER_TIMEOUT, self._headers_late)

    def _got_request(self) -> bool:
        return bool(self._messages) or self._request_in_progress

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_guard is not None and self._got_request():
            self._header_guard.cancel()
            self._header_guard = None

    def _headers_late(self) -> None:
        self._header_guard = None
        if not self._got_request():
            log.debug("closed a connection that sent no complete request headers within %.0fs", HEADER_TIMEOUT)
            self.force_close()
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc) -> None:
        if self._header_guard is not None:
            self._header_guard.cancel()
            self._header_guard = None
        super().connection_lost(exc)


class _GuardedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """web.AppRunner whose connections have the read timeouts above."""

    def __init__(self, app: web.Application, **kwargs):
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        # aiohttp builds its Server here; ours differs only in the handler class it makes
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        return server
