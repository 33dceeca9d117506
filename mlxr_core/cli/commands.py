"""Which ``mlxr`` subcommands exist: the built-in ones, then those plugins add.

Each built-in command lives in its own module exposing ``add_parser(subparsers)``; the module is
imported when the command line is built, so it must be cheap to import (MLX, the GGUF library and
the HTTP stack are imported inside the handlers). A command module that is missing or broken
leaves the other commands working.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import MlxrError
from mlxr_core.plugins import call_hook

if TYPE_CHECKING:
    from mlxr_core.plugins import PluginHost

log = logging.getLogger(__name__)

#: Built-in command -> module with ``add_parser(subparsers)``, in ``mlxr --help`` order.
BUILTIN_COMMANDS = {
    "serve": "mlxr_core.cli.serve",
    "launch": "mlxr_core.cli.launch",
    "generate": "mlxr_core.cli.generate",
    "bench": "mlxr_core.cli.bench",
    "info": "mlxr_core.cli.info",
    "convert": "mlxr_core.cli.convert",
    "demo-vision": "mlxr_core.cli.demo_vision",
    "plugins": "mlxr_core.cli.plugins_cmd",
    "config": "mlxr_core.cli.config_cmd",
    "kernels": "mlxr_core.cli.kernels_cmd",
}

Subparsers = argparse._SubParsersAction  # type: ignore[type-arg]


def add_builtin_commands(subparsers: Subparsers) -> None:
    """Add every built-in command; one that cannot be imported answers with its error when run."""
    for name, module_name in BUILTIN_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
            module.add_parser(subparsers)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                log.debug("command %s is not available (%s is not installed)", name, module_name)
                continue
            _add_broken(subparsers, name, exc)
        except Exception as exc:
            _add_broken(subparsers, name, exc)


def add_plugin_commands(host: PluginHost, subparsers: Subparsers) -> None:
    """Let each loaded plugin add its commands (``mlxr_register_commands``), one at a time.

    A plugin that raises, or claims a command name that is taken, is marked failed in ``host`` and
    the others keep their commands. What each plugin added is recorded as its ``commands``.
    """
    for impl in host.manager.hook.mlxr_register_commands.get_hookimpls():
        info = host.plugins.get(impl.plugin_name)
        before = dict(subparsers.choices)
        try:
            call_hook(impl.plugin_name, "mlxr_register_commands", impl.function, cli=subparsers)
            # Python 3.10's argparse silently replaces a command of the same name; 3.11+ raises.
            taken = sorted(name for name, parser in before.items() if subparsers.choices[name] is not parser)
            if taken:
                subparsers.choices.update({name: before[name] for name in taken})
                raise ValueError(f"command name(s) already taken: {', '.join(taken)}")
        except Exception as exc:
            log.warning("plugin %s failed to add its commands: %s: %s", impl.plugin_name, type(exc).__name__, exc)
            if info is not None:
                import traceback

                info.state = "failed"
                info.error = f"mlxr_register_commands raised: {type(exc).__name__}: {exc}"
                info.traceback = "".join(traceback.format_exception(exc))
            continue
        added = sorted(set(subparsers.choices) - set(before))
        if info is not None and added:
            info.provides["commands"] = added


def _add_broken(subparsers: Subparsers, name: str, exc: BaseException) -> None:
    log.debug("command %s is broken", name, exc_info=exc)
    parser = subparsers.add_parser(
        name, help=f"(unavailable: {type(exc).__name__}: {exc})", add_help=False
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER)

    def handler(args: Any) -> int:
        raise MlxrError(f"the {name} command is unavailable: {type(exc).__name__}: {exc}") from exc

    parser.set_defaults(handler=handler)
