"""The ``mlxr`` command line: ``main(argv) -> exit status``.

Exit statuses: 0 success, 1 failure, 2 a config or usage error, 130 interrupted. An
:class:`~mlxr_core.errors.MlxrError` is printed as ``mlxr: error: ...`` without a traceback, unless
``-v`` / ``MLXR_DEBUG=1`` asks for one (and for debug logs).

``mlxr --help`` lists plugin commands too, so it loads the plugins; running a built-in command
does not load them for the command line (the command loads what it needs), and nothing here
imports MLX.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from mlxr_core import __version__
from mlxr_core.cli.commands import BUILTIN_COMMANDS, add_builtin_commands, add_plugin_commands
from mlxr_core.errors import ConfigError, MlxrError
from mlxr_core.plugins import env_flag, load_plugins

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser(*, with_plugin_commands: bool = True) -> argparse.ArgumentParser:
    """The ``mlxr`` parser: built-in commands, then (optionally) the plugins' commands."""
    parser = argparse.ArgumentParser(
        prog="mlxr",
        description="mlxr: a plugin-based LLM inference runtime on MLX.",
        epilog="Run `mlxr COMMAND --help` for a command's options. Environment: MLXR_DEBUG=1 for "
        "tracebacks, MLXR_DISABLE_PLUGINS=a,b, MLXR_STRICT_PLUGINS=1, MLXR_TRACE_HOOKS=1 (log every "
        "hook call), MLXR_SECTION__KEY=value.",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    parser.add_argument(
        "-v", "--verbose", dest="debug", action="store_true",
        help="debug logs, and a traceback with every error",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_builtin_commands(subparsers)
    if with_plugin_commands:
        # Never strict here: a broken plugin must not take `mlxr --help` down with it.
        add_plugin_commands(load_plugins(strict=False), subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mlxr`` command line; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = env_flag("MLXR_DEBUG")
    try:
        parser = build_parser(with_plugin_commands=_needs_plugin_commands(argv))
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = debug or args.debug
    if debug or env_flag("MLXR_TRACE_HOOKS"):
        from mlxr_core.logs import setup_logging

        # Hook traces are info lines: show them for every command, not only `mlxr serve`.
        setup_logging("debug" if debug else "info")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`mlxr plugins | head`); keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except MlxrError as exc:
        if debug:
            traceback.print_exc()
        print(f"mlxr: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
    except Exception as exc:
        if debug:
            traceback.print_exc()
        if isinstance(exc, ImportError) and (backend := missing_mlx_backend(exc)):
            print(f"mlxr: error: {backend}", file=sys.stderr)
            return EXIT_FAILURE
        hint = "" if debug else " (run with -v or MLXR_DEBUG=1 for the traceback)"
        print(f"mlxr: error: internal error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return EXIT_FAILURE


def missing_mlx_backend(exc: ImportError) -> str | None:
    """What to install when MLX cannot be imported: plain ``mlx`` on Linux has no backend library
    (``libmlx.so``) until an extra brings one. None for any other import error."""
    if "libmlx" not in str(exc) and exc.name not in ("mlx", "mlx.core"):
        return None
    return (
        f"MLX cannot load ({exc}): it needs a backend on Linux: pip install 'mlxr[cpu]' for the "
        "CPU, or MLX's CUDA build for an NVIDIA GPU (pip install 'mlx[cuda12]' or 'mlx[cuda13]')"
    )


def _needs_plugin_commands(argv: Sequence[str]) -> bool:
    """Whether parsing ``argv`` needs the plugins' commands: not for a built-in command."""
    for arg in argv:
        if arg == "--version":
            return False
        if not arg.startswith("-"):
            return arg not in BUILTIN_COMMANDS
    return True  # `mlxr`, `mlxr --help`: list every command


def _version_line() -> str:
    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"mlxr {__version__} (mlx {mlx}, python {python})"


if __name__ == "__main__":
    sys.exit(main())
