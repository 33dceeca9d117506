"""``mlxr plugins``: every plugin found, its state, what it provides, and why it failed.

The diagnostic command: it exits 0 even when a plugin failed (the failure is shown), unless
``--strict``, ``plugins.strict`` in ``--config`` or ``MLXR_STRICT_PLUGINS=1`` asks for a non-zero
exit. Listing plugins never imports MLX: registration only names ``"module:attr"`` targets.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from mlxr_core.cli.commands import BUILTIN_COMMANDS, Subparsers, add_plugin_commands
from mlxr_core.hookspecs import HOOK_API_VERSION
from mlxr_core.plugins import env_flag

if TYPE_CHECKING:
    from mlxr_core.plugins import PluginHost

STATE_STYLES = {"ok": "green", "failed": "bold red", "disabled": "yellow"}


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``plugins`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins: state, what each provides, errors",
        description=(
            "List every plugin of the `mlxr` entry-point group: its distribution and version, "
            "state (ok, failed, disabled), whether it is essential, what it provides per kind "
            "and, for a failed plugin, the error. Exits 0 even when a plugin failed, unless "
            "--strict or MLXR_STRICT_PLUGINS=1."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="also show module paths and tracebacks"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit non-zero when any plugin failed"
    )
    parser.add_argument(
        "--config", metavar="FILE",
        help="apply this server config's plugins.disable / plugins.require / plugins.strict",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr plugins``."""
    from mlxr_core.plugins import load_plugins

    disable: list[str] = []
    require: list[str] = []
    strict = args.strict or env_flag("MLXR_STRICT_PLUGINS")
    if args.config:
        from mlxr_core.config.loader import load_config

        config = load_config(args.config)
        disable, require = config.plugins.disable, config.plugins.require
        strict = strict or config.plugins.strict
    host = load_plugins(disable=disable, require=require, strict=False)
    # Build the plugins' commands on a scratch parser, to show them and catch the ones that fail
    # (taking a built-in command's name included).
    scratch = argparse.ArgumentParser().add_subparsers()
    for name in BUILTIN_COMMANDS:
        scratch.add_parser(name)
    add_plugin_commands(host, scratch)
    report = plugin_report(host)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report, verbose=args.verbose)
    failed = [p["name"] for p in report if p["state"] == "failed"]
    if strict and failed:
        print(f"mlxr: error: plugin(s) failed (strict): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def plugin_report(host: PluginHost) -> list[dict[str, Any]]:
    """One JSON-ready record per plugin, sorted by name."""
    sections = host.registries.config_sections
    overrides: dict[str, list[str]] = {}
    overridden: dict[str, list[str]] = {}
    for kind, registry in host.registries.all().items():
        for entry in registry:
            for old in entry.replaced:
                overrides.setdefault(entry.plugin, []).append(f"{kind}:{entry.name} (from {old.plugin})")
                overridden.setdefault(old.plugin, []).append(f"{kind}:{entry.name} (by {entry.plugin})")
    report = []
    for info in sorted(host.plugins.values(), key=lambda i: i.name):
        schema = sections.get(info.name)
        report.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "module": info.module,
                "state": info.state,
                "essential": info.essential,
                "hook_api": info.hook_api,
                "provides": {kind: list(names) for kind, names in info.provides.items()},
                "config_section": (
                    f"plugins.config.{info.name} ({schema.__module__}.{schema.__qualname__})"
                    if schema is not None else None
                ),
                "overrides": overrides.get(info.name, []),
                "overridden": overridden.get(info.name, []),
                "error": info.error,
                "traceback": info.traceback,
            }
        )
    return report


def print_table(report: list[dict[str, Any]], *, verbose: bool = False) -> None:
    """Print ``report`` as a rich table (tracebacks below it with ``verbose``)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False)
    table = Table(title="mlxr plugins", title_justify="left")
    table.add_column("plugin", style="bold", no_wrap=True)
    table.add_column("distribution")
    table.add_column("version", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("essential", no_wrap=True)
    if verbose:
        table.add_column("module")
        table.add_column("hook API", no_wrap=True)
    table.add_column("provides")
    table.add_column("error", style="red")
    for plugin in report:
        lines = [f"{kind}: {', '.join(names)}" for kind, names in plugin["provides"].items()]
        if plugin["config_section"]:
            lines.append(f"config: plugins.config.{plugin['name']}")
        lines += [f"overrides {item}" for item in plugin["overrides"]]
        lines += [f"overridden: {item}" for item in plugin["overridden"]]
        state = plugin["state"]
        row = [
            escape(plugin["name"]),
            escape(plugin["distribution"] or "-"),
            escape(plugin["version"] or "-"),
            f"[{STATE_STYLES.get(state, '')}]{state}[/]",
            "yes" if plugin["essential"] else "",
        ]
        if verbose:
            row += [escape(plugin["module"] or "-"), escape(str(plugin["hook_api"] or "-"))]
        row += [escape("\n".join(lines)), escape(plugin["error"] or "")]
        table.add_row(*row)
    console.print(table)
    console.print(f"mlxr hook API {HOOK_API_VERSION}", highlight=False)
    counts = {state: sum(p["state"] == state for p in report) for state in ("ok", "failed", "disabled")}
    console.print(
        f"{len(report)} plugins: {counts['ok']} ok, {counts['failed']} failed, "
        f"{counts['disabled']} disabled"
    )
    if verbose:
        for plugin in report:
            if plugin["traceback"]:
                console.rule(f"{escape(plugin['name'])}: traceback")
                console.print(escape(plugin["traceback"]), highlight=False)
