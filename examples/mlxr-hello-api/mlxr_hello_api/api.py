"""The ``hello`` API: ``GET /v1/hello`` and ``POST /v1/tokenize``, as one Litestar router.

Imported only when a server mounts the API (``apis: [..., hello]``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.params import JSONBody

from mlxr_core.plugin_api import EngineStopped, MlxrError, ServerContext, exception_handlers
from mlxr_hello_api import HelloConfig


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    text: str
    add_special_tokens: bool = True


class TokenizeResponse(msgspec.Struct):
    model: str
    tokens: list[int]
    count: int


def make_router(ctx: ServerContext) -> Router:
    """Build the router; ``ctx.plugin_config["hello"]`` is this plugin's validated section."""
    settings: HelloConfig = ctx.plugin_config.get("hello", HelloConfig())

    @get("/hello", sync_to_thread=False)
    def hello() -> dict[str, Any]:
        return {"message": f"{settings.greeting}, world", "models": sorted(ctx.engine.models)}

    # Tokenizing is CPU work: run it in a worker thread, not on the event loop.
    @post("/tokenize", sync_to_thread=True, status_code=200)
    def tokenize(data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
        if ctx.engine.state != "ready":
            raise EngineStopped(f"the engine is {ctx.engine.state}; retry shortly")
        tokens = ctx.engine.encode(data.model, data.text, add_special_tokens=data.add_special_tokens)
        return TokenizeResponse(model=data.model, tokens=tokens, count=len(tokens))

    def error_body(exc: MlxrError) -> bytes:
        # This API's own wire format; other APIs keep theirs.
        return msgspec.json.encode({"error": exc.message, "field": exc.field})

    handlers = [hello, tokenize] if settings.tokenize else [hello]
    # mlxr's handlers around that body: statuses and Retry-After kept, Litestar's own errors
    # (a malformed body, a wrong method) and unexpected ones in the same shape, no tracebacks.
    return Router(path="/v1", route_handlers=handlers, exception_handlers=exception_handlers(error_body))
