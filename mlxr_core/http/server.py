"""The HTTP server: one Litestar app that mounts the API plugins named in ``apis:``.

:func:`build_app` is all ``mlxr serve`` needs besides uvicorn, and what embedders and tests call
(:class:`~mlxr_core.http.context.ServerContext` is what every API factory receives):

    ctx = ServerContext(config=config, host=host, engine=Engine(config, host))
    app = build_app(ctx)

The app starts the engine in the background when it starts (so ``GET /health`` answers 503 while
models load) and stops it when it shuts down. Each API plugin's factory
``make(ctx) -> litestar.Router`` returns a router that carries its own exception handlers, so an
error reaches the client in that API's wire format -- the 401 of a missing API key included, since
the key check is a guard that runs inside each route (:mod:`mlxr_core.http.access`), and the 404 of
a path no route serves under the API's prefix (``/v1/nope``, ``/api/nope``; the 405 of a method the
path does not answer likewise).

Operations: ``GET /metrics`` (Prometheus, :mod:`mlxr_core.http.metrics`), one access-log line and an
``x-request-id`` per request, a body size limit (``server.max_body_bytes``, 413), CORS only for
``server.cors_origins``, and :func:`drain` for graceful shutdown: refuse new requests, let the
running ones finish for ``server.shutdown_timeout`` seconds, then end the rest with an error event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from litestar import Litestar, MediaType, Response, Router, get
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from mlxr_core.errors import ConfigError, EngineStopped, MlxrError, PluginLoadError, close_matches
from mlxr_core.http.access import ApiKeys, RequestLog, api_key_guard, json_body_guard
from mlxr_core.http.context import InflightRequests, ServerContext
from mlxr_core.http.errors import allow_every_method, unmatched_route_handlers
from mlxr_core.http.frontend import JsonRequest
from mlxr_core.http.metrics import CONTENT_TYPE
from mlxr_core.http.openapi import StructSchemas
from mlxr_core.model.chat_template import interrupt_renders

if TYPE_CHECKING:
    from mlxr_core.config.schema import ServerConfig

log = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) while models load.
LOADING_RETRY_AFTER_S = 5
#: Seconds cancelled requests get to send their final error event at the end of a drain.
CANCEL_GRACE_S = 5.0


def build_app(ctx: ServerContext) -> Litestar:
    """Build the app: ``GET /health``, ``GET /metrics`` and the router of every API in ``config.apis``,
    behind the API-key guard, the body size limit and the access log.

    Raises :class:`~mlxr_core.errors.ConfigError` naming ``apis`` when an API is not registered
    by any loaded plugin, and :class:`~mlxr_core.errors.PluginLoadError` when an API plugin's
    factory fails or returns something other than a ``litestar.Router``.
    """
    routers = [_make_router(ctx, name) for name in _api_names(ctx)]
    server = ctx.config.server
    cors = CORSConfig(allow_origins=list(server.cors_origins)) if server.cors_origins else None
    app = Litestar(
        route_handlers=[_health_route(ctx), _metrics_route(ctx), *routers],
        lifespan=[_engine_lifespan(ctx)],
        cors_config=cors,
        guards=[api_key_guard(ApiKeys(client_keys(server), exempt=server.auth_exempt)), json_body_guard],
        # Routes outside the API routers (/health, /metrics) answer errors as {"error": "..."}; a
        # path no route serves, in the shape of the API it falls under (/v1/..., /api/...).
        exception_handlers={MlxrError: _plain_error, **unmatched_route_handlers(routers, _plain_error)},
        before_send=[allow_every_method],
        request_max_body_size=server.max_body_bytes,
        # Typed bodies (``data: JSONBody[Struct]``) decoded strictly, depth-bounded, errors naming the field.
        request_class=JsonRequest,
        # Structs documented by msgspec's own JSON schema: the published schema is the decoder's.
        plugins=[StructSchemas()],
        # mlxr configures its own and uvicorn's loggers; Litestar must not touch the root logger.
        logging_config=None,
        state=State({"mlxr": ctx}),
    )
    # Outermost, around Litestar's own exception and CORS layers: app-level Litestar middleware
    # only wraps matched routes, and the access log must see 404s and 405s too.
    app.asgi_handler = RequestLog(
        app.asgi_handler, ctx.metrics, log_requests=server.access_log, arrivals=ctx.engine.arrivals
    )
    return app


def client_keys(server: ServerConfig) -> list[str]:
    """The keys every route takes: ``api_keys`` and, where they are set, the admin keys too (without
    ``api_keys`` the API is open and the admin keys guard administration only)."""
    return [*server.api_keys, *server.admin_api_keys] if server.api_keys else []


async def drain(ctx: ServerContext, timeout: float) -> None:
    """Graceful shutdown of the HTTP side: refuse new generation requests (503), stop the chat
    templates rendering (:func:`~mlxr_core.model.chat_template.interrupt_renders`), wait up to
    ``timeout`` seconds for those in flight, then cancel the rest, which end with a final error
    event (a stream) or a 503 (a whole reply). Idempotent; returns once they have ended."""
    inflight = ctx.inflight
    inflight.draining = True
    interrupt_renders()  # a request still rendering its prompt would be refused anyway
    if not len(inflight):
        return
    log.info("shutting down: waiting up to %gs for %d request(s)", timeout, len(inflight))
    if await inflight.wait_empty(timeout):
        return
    count = inflight.cancel_all()
    log.warning("shutdown_timeout (%gs) reached: ending %d request(s) with an error", timeout, count)
    if not await inflight.wait_empty(CANCEL_GRACE_S):
        _fail_unanswered(inflight)
        await inflight.wait_empty(CANCEL_GRACE_S)


async def end_now(ctx: ServerContext) -> int:
    """A forced shutdown (a second signal during the drain): cancel every request in flight at
    once, so each still ends with its final error event (a stream) or a 503, and give them
    ``CANCEL_GRACE_S`` to send it. Returns how many were cancelled."""
    inflight = ctx.inflight
    inflight.draining = True
    interrupt_renders()
    count = inflight.cancel_all()
    if count:
        log.warning("shutdown forced: ending %d request(s) with an error", count)
        if not await inflight.wait_empty(CANCEL_GRACE_S):
            _fail_unanswered(inflight)
            await inflight.wait_empty(CANCEL_GRACE_S)
    return count


def _fail_unanswered(inflight: InflightRequests) -> None:
    """The engine did not end the cancelled requests (a step that never returns: a rank of the
    group died and the collective waits on it): end them here, so each stream still gets its final
    error event before the connections close."""
    count = inflight.fail_all(
        EngineStopped("the server is shutting down and its engine stopped answering; retry once it is back")
    )
    log.warning("%d request(s) did not end after cancellation: the engine does not answer; ended "
                "them with an error", count)  # fmt: skip


def _api_names(ctx: ServerContext) -> list[str]:
    registry = ctx.host.registries.apis
    names = list(ctx.config.apis)
    if not names:
        raise ConfigError("apis: lists no API; the server would answer nothing but /health", field="apis")
    for name in names:
        if name not in registry:
            available = registry.names()
            raise ConfigError(
                f"apis: unknown API {name!r} (available: {', '.join(available) or 'none'})"
                f"{close_matches(name, available)}",
                field="apis",
            )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"apis: {', '.join(duplicates)} listed more than once", field="apis")
    return names


def _make_router(ctx: ServerContext, name: str) -> Router:
    entry = ctx.host.registries.apis.entry(name)
    try:
        router = entry.load()(ctx)
    except Exception as exc:
        raise PluginLoadError(
            f"API {name!r} of plugin {entry.plugin!r} failed to build its router: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(router, Router):
        raise PluginLoadError(
            f"API {name!r} of plugin {entry.plugin!r} returned {type(router).__name__}, "
            f"not a litestar.Router"
        )
    return router


def _engine_lifespan(ctx: ServerContext) -> Any:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        engine = ctx.engine
        # An engine started by the caller (tests, embedding) stays the caller's to stop.
        owned = engine.state == "created"
        if owned:
            engine.start(wait=False)
        try:
            yield
        finally:
            # Under uvicorn the connections have closed by now (serve drains on the signal); an
            # embedding server may go straight here.
            await drain(ctx, ctx.config.server.shutdown_timeout)
            if owned:
                # stop() joins the engine thread; off the event loop so in-flight streams can
                # still receive their last events.
                await anyio.to_thread.run_sync(engine.stop)

    return lifespan


def _health_route(ctx: ServerContext) -> Any:
    @get("/health", sync_to_thread=False, include_in_schema=False)
    def health() -> Response[dict[str, Any]]:
        return health_response(ctx)

    return health


def _plain_error(request: Any, exc: MlxrError) -> Response[dict[str, str]]:
    return Response({"error": exc.message}, status_code=exc.status)


def _metrics_route(ctx: ServerContext) -> Any:
    @get("/metrics", sync_to_thread=False, include_in_schema=False, media_type=MediaType.TEXT)
    def metrics() -> Response[bytes]:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return metrics


def health_response(ctx: ServerContext) -> Response[dict[str, Any]]:
    """``GET /health``: 200 with the served models and memory once the engine is ready, else 503."""
    engine = ctx.engine
    state = engine.state
    body: dict[str, Any] = {
        "status": "ok" if state == "ready" else state,
        "state": state,
        "models": sorted(engine.served),
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "queue_depth": engine.queue_depth,
    }
    if state == "ready":
        body["memory"] = engine.memory()
        return Response(body, status_code=HTTP_200_OK)
    headers = {}
    if state == "failed":
        body["error"] = str(engine.error)
    elif state in ("created", "loading"):
        headers["Retry-After"] = str(LOADING_RETRY_AFTER_S)
    return Response(body, status_code=HTTP_503_SERVICE_UNAVAILABLE, headers=headers)
