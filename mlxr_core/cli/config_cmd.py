"""``mlxr config check FILE`` and ``mlxr config show [FILE]``.

``check`` validates a server config as ``mlxr serve`` would before loading any model: the schema
(strict), each plugin's own section, that every name it uses (APIs, formats, architectures,
decoders, kernels) is registered by a loaded plugin, and that every model path exists. It prints
``OK`` or every problem, and exits 2 on a problem.
"""

from __future__ import annotations

import argparse
import sys

from mlxr_core.cli.commands import Subparsers

EXIT_INVALID = 2


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``config`` command (``check``, ``show``) to the ``mlxr`` command line."""
    parser = subparsers.add_parser("config", help="check or show a server config")
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate a config, including plugin sections and model paths",
        description=(
            "Validate a server config as `mlxr serve` would before loading any model: the schema, "
            "each plugin's section, the plugin names it uses (APIs, formats, architectures, "
            "decoders, kernels) and the model paths. Prints OK, or every problem and exits 2."
        ),
    )
    check.add_argument("file", metavar="FILE", help="server config (YAML)")
    check.set_defaults(handler=run_check)
    show = actions.add_parser(
        "show",
        help="print the effective config (defaults < FILE < MLXR_* environment) as YAML",
    )
    show.add_argument("file", metavar="FILE", nargs="?", help="server config (default: the embedded one)")
    show.set_defaults(handler=run_show)


def run_check(args: argparse.Namespace) -> int:
    """Handle ``mlxr config check``."""
    from mlxr_core.checks import check_config
    from mlxr_core.config.loader import load_config
    from mlxr_core.errors import PluginLoadError
    from mlxr_core.plugins import load_plugins

    config = load_config(args.file)
    try:
        host = load_plugins(
            disable=config.plugins.disable, require=config.plugins.require, strict=False
        )
    except PluginLoadError as exc:  # plugins.require names a missing or mismatched plugin
        print(f"mlxr: error: {args.file}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    for info in host.failed:
        print(f"warning: plugin {info.name} failed: {info.error}", file=sys.stderr)
    if config.plugins.strict and host.failed:
        names = ", ".join(info.name for info in host.failed)
        print(f"mlxr: error: {args.file}: plugins.strict is set and plugin(s) failed: {names}", file=sys.stderr)
        return EXIT_INVALID
    check_config(config, host)
    from mlxr_core.model.paths import default_model_name, resolve_model_path

    # The names clients use, unnamed models' defaults included (every path resolved above).
    names = ", ".join(m.name or default_model_name(resolve_model_path(m.path, join=False)) for m in config.models)
    print(f"OK: {args.file} (models: {names}; apis: {', '.join(config.apis) or 'none'})")
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Handle ``mlxr config show``."""
    import cattrs
    import yaml

    from mlxr_core.config.loader import load_config

    config = load_config(args.file)
    shown = cattrs.unstructure(config)
    server = shown.get("server", {})
    for secret in ("api_keys", "admin_api_keys"):  # never print secrets
        if server.get(secret):
            server[secret] = ["***"] * len(server[secret])
    if server.get("compaction_secret"):
        server["compaction_secret"] = "***"
    print(yaml.safe_dump(shown, sort_keys=False), end="")
    return 0
