"""The web page's routes: ``GET /ui/`` (the page), ``/ui/app.js``, ``/ui/app.css``, and ``GET /``
redirecting to the page.

The three files ship in this package (``static/``) and are read once, when the router is built.
They hold no data and are the same for everyone, so they are served without an API key
(:data:`mlxr_core.http.access.PUBLIC`): a browser cannot add a header to a page it navigates to.
Every request the page then makes (``/v1/models``, ``/v1/chat/completions``, ``/metrics``) carries the
key the user typed into it and is checked like any other client's. A strict Content-Security-Policy
keeps the page to its own script and style and its requests to this server.
"""

from __future__ import annotations

import logging
from importlib import resources

from litestar import Response, Router, get
from litestar.response import Redirect

from mlxr_core.http.access import PUBLIC
from mlxr_core.http.context import ServerContext

log = logging.getLogger(__name__)

#: Where the page lives.
PATH = "/ui"
#: The shipped files and their media types (Litestar adds ``charset=utf-8`` to text types).
FILES = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
#: Only this server's own files and APIs: no inline script, no other origin, no framing.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # Small files: always revalidate, so an upgraded server never runs a stale script.
    "Cache-Control": "no-cache",
}


def make_router(ctx: ServerContext) -> Router:
    """The web page as a Litestar router (the ``webui`` entry of ``apis:``)."""
    if "openai" not in ctx.config.apis:
        log.warning("webui: the page chats through the openai API, which apis: does not list")
    static = resources.files(__package__) / "static"
    contents = {name: (static / name).read_bytes() for name in FILES}

    def serve(name: str) -> Response[bytes]:
        return Response(contents[name], media_type=FILES[name], headers=HEADERS)

    @get("/", sync_to_thread=False, opt={PUBLIC: True}, include_in_schema=False)
    def page() -> Response[bytes]:
        return serve("index.html")

    @get("/app.js", sync_to_thread=False, opt={PUBLIC: True}, include_in_schema=False)
    def script() -> Response[bytes]:
        return serve("app.js")

    @get("/app.css", sync_to_thread=False, opt={PUBLIC: True}, include_in_schema=False)
    def style() -> Response[bytes]:
        return serve("app.css")

    @get("/", sync_to_thread=False, opt={PUBLIC: True}, include_in_schema=False)
    def root() -> Redirect:
        return Redirect(f"{PATH}/")

    return Router(path="/", route_handlers=[root, Router(path=PATH, route_handlers=[page, script, style])])
