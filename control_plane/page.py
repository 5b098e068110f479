"""The built-in page at GET /: a live map of the KV blocks, charts of the queues and pools, and a
chat playground (control_plane/static/: plain HTML, CSS and JavaScript, no build step). It reads
GET /debug/kv/blocks (control_plane/kv_blocks.py) and the OpenAI endpoints, with the API key the
user types when the server has one. `--no-ui` leaves these routes out."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
ASSETS = "/ui/"   # app.js, style.css: public, like the page (they hold nothing secret)
# the page runs only its own script: no inline script, no handler attribute, no other origin
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache",
}


def is_public(path: str) -> bool:
    """The page and its assets load without a key: the page then asks for it."""
    return path == "/" or path.startswith(ASSETS)


def add_routes(app: web.Application, key_required: bool) -> None:
    # the page learns from the server whether to ask for a key before its first call, so that it never
    # makes a call that is bound to fail
    html = (STATIC / "index.html").read_text().replace("{{auth}}", "key" if key_required else "none")

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html", headers=SECURITY_HEADERS)

    app.router.add_get("/", index)
    app.router.add_static(ASSETS, STATIC, append_version=False)
