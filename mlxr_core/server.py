"""The HTTP server: one Litestar app that mounts the API plugins named in ``apis:``.

:func:`build_app` is all ``mlxr serve`` needs besides uvicorn, and what embedders and tests call:

    ctx = ServerContext(config=config, host=host, engine=Engine(config, host))
    app = build_app(ctx)

The app starts the engine in the background when it starts (so ``GET /health`` answers 503 while
models load) and stops it, draining the running request, when it shuts down. Each API plugin's
factory ``make(ctx) -> litestar.Router`` returns a router that carries its own exception handlers,
so an error reaches the client in that API's wire format.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from litestar import Litestar, Response, Router, get
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from mlxr_core.errors import ConfigError, PluginLoadError, close_matches

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)

#: Seconds a client is told to wait (``Retry-After``) while models load.
LOADING_RETRY_AFTER_S = 5


@attrs.define
class ServerContext:
    """What every API factory receives: the config, the plugin host and the engine.

    Factories close over it in their handlers; ``app.state["mlxr"]`` holds it for middleware.
    """

    config: Config
    host: PluginHost
    engine: Engine
    #: ``time.time()`` when the server context was made; /health reports the uptime from it.
    started_at: float = attrs.field(factory=time.time)
    #: Plugin name -> its validated ``plugins.config.<name>`` section (an instance of its schema).
    plugin_config: dict[str, Any] = attrs.field(factory=dict)


def build_app(ctx: ServerContext) -> Litestar:
    """Build the app: ``GET /health`` plus the router of every API in ``config.apis``.

    Raises :class:`~mlxr_core.errors.ConfigError` naming ``apis`` when an API is not registered
    by any loaded plugin, and :class:`~mlxr_core.errors.PluginLoadError` when an API plugin's
    factory fails or returns something other than a ``litestar.Router``.
    """
    routers = [_make_router(ctx, name) for name in _api_names(ctx)]
    config = ctx.config
    cors = CORSConfig(allow_origins=list(config.server.cors_origins)) if config.server.cors_origins else None
    return Litestar(
        route_handlers=[_health_route(ctx), *routers],
        lifespan=[_engine_lifespan(ctx)],
        cors_config=cors,
        # mlxr configures its own and uvicorn's loggers; Litestar must not touch the root logger.
        logging_config=None,
        state=State({"mlxr": ctx}),
    )


def _api_names(ctx: ServerContext) -> list[str]:
    registry = ctx.host.registries.apis
    names = list(ctx.config.apis)
    if not names:
        raise ConfigError("apis: lists no API; the server would answer nothing but /health", param="apis")
    for name in names:
        if name not in registry:
            available = registry.names()
            raise ConfigError(
                f"apis: unknown API {name!r} (available: {', '.join(available) or 'none'})"
                f"{close_matches(name, available)}",
                param="apis",
            )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"apis: {', '.join(duplicates)} listed more than once", param="apis")
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


def health_response(ctx: ServerContext) -> Response[dict[str, Any]]:
    """``GET /health``: 200 with the served models and memory once the engine is ready, else 503."""
    engine = ctx.engine
    state = engine.state
    body: dict[str, Any] = {
        "status": "ok" if state == "ready" else state,
        "state": state,
        "models": sorted(engine.models),
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "queue_depth": engine.queue_depth,
    }
    if state == "ready":
        body["memory"] = mlx_memory()
        return Response(body, status_code=HTTP_200_OK)
    headers = {}
    if state == "failed":
        body["error"] = str(engine.error)
    elif state in ("created", "loading"):
        headers["Retry-After"] = str(LOADING_RETRY_AFTER_S)
    return Response(body, status_code=HTTP_503_SERVICE_UNAVAILABLE, headers=headers)


def mlx_memory() -> dict[str, int]:
    """MLX allocator counters, in bytes.

    Safe from any thread once the engine has loaded: each call reads a counter of the allocator
    singleton (already built by the engine thread) and touches no stream, graph or device queue.
    """
    import mlx.core as mx

    return {
        "active_bytes": int(mx.get_active_memory()),
        "peak_bytes": int(mx.get_peak_memory()),
        "cache_bytes": int(mx.get_cache_memory()),
    }
