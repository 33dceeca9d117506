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
from mlxr_core.testing.zoo import recorded_summary

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
                "notes": fallback_notes(host, info.name),
                "overrides": overrides.get(info.name, []),
                "overridden": overridden.get(info.name, []),
                "error": info.error,
                "traceback": info.traceback,
            }
        )
    return report


def fallback_notes(host: PluginHost, plugin: str) -> list[str]:
    """What each architecture fallback ``plugin`` registered adds beyond the native architectures
    (``mlx-lm bridge: 112 model types (14 more served natively)``), or why it serves none."""
    native = set(host.registries.archs.names())
    notes = []
    for entry in host.registries.arch_fallbacks:
        if entry.plugin != plugin:
            continue
        label = entry.meta.get("label", entry.name)
        model_types = entry.meta.get("model_types")
        if model_types is None:
            notes.append(f"{label}: unavailable ({entry.meta.get('unavailable', 'no reason given')})")
            continue
        added = set(model_types) - native
        shadowed = len(set(model_types)) - len(added)
        more = f" ({shadowed} more served natively)" if shadowed else ""
        notes.append(f"{label}: {len(added)} model types{more}")
    return notes


def print_table(report: list[dict[str, Any]], *, verbose: bool = False, console: Any = None) -> None:
    """Print ``report``: a rich table on a terminal, whose cells wrap and never cut a name; one
    block per plugin otherwise (a pipe, a log), at any width. Tracebacks follow with ``verbose``."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console(soft_wrap=False)
    if console.is_terminal:
        console.print(_table(report, verbose=verbose))
    else:
        for plugin in report:
            _print_block(console, plugin, verbose=verbose)
    console.print(f"mlxr hook API {HOOK_API_VERSION}", highlight=False)
    counts = {state: sum(p["state"] == state for p in report) for state in ("ok", "failed", "disabled")}
    console.print(
        f"{len(report)} plugins: {counts['ok']} ok, {counts['failed']} failed, "
        f"{counts['disabled']} disabled"
    )
    zoo = recorded_summary()
    if zoo:
        console.print(zoo, highlight=False)
    if verbose:
        for plugin in report:
            if plugin["traceback"]:
                console.rule(f"{escape(plugin['name'])}: traceback")
                console.print(escape(plugin["traceback"]), highlight=False)


def _provides(plugin: dict[str, Any]) -> list[str]:
    lines = [f"{kind}: {', '.join(names)}" for kind, names in plugin["provides"].items()]
    lines += plugin["notes"]
    if plugin["config_section"]:
        lines.append(f"config: plugins.config.{plugin['name']}")
    lines += [f"overrides {item}" for item in plugin["overrides"]]
    lines += [f"overridden: {item}" for item in plugin["overridden"]]
    return lines


def _table(report: list[dict[str, Any]], *, verbose: bool) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="mlxr plugins", title_justify="left")
    # "fold": a name wider than its column breaks onto the next line instead of ending in "…".
    table.add_column("plugin", style="bold", overflow="fold")
    table.add_column("distribution", overflow="fold")
    table.add_column("version", overflow="fold")
    table.add_column("state", no_wrap=True)
    table.add_column("essential", no_wrap=True)
    if verbose:
        table.add_column("module", overflow="fold")
        table.add_column("hook API", overflow="fold")
    table.add_column("provides", overflow="fold")
    table.add_column("error", style="red", overflow="fold")
    for plugin in report:
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
        row += [escape("\n".join(_provides(plugin))), escape(plugin["error"] or "")]
        table.add_row(*row)
    return table


def _print_block(console: Any, plugin: dict[str, Any], *, verbose: bool) -> None:
    """``NAME  DISTRIBUTION VERSION  STATE[, essential]``, then its details indented, one a line."""
    head = [plugin["name"], f"{plugin['distribution'] or '-'} {plugin['version'] or '-'}", plugin["state"]]
    if plugin["essential"]:
        head[-1] += ", essential"
    lines = [f"module: {plugin['module'] or '-'}", f"hook API: {plugin['hook_api'] or '-'}"] if verbose else []
    lines += _provides(plugin)
    if plugin["error"]:
        lines.append(f"error: {plugin['error']}")
    console.out("  ".join(head), highlight=False)
    for line in lines:
        console.out(f"    {line}", highlight=False)
