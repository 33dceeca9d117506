"""``mlxr config check FILE`` and ``mlxr config show [FILE]``.

``check`` validates a server config as ``mlxr serve`` would before loading any model: the schema
(strict), each plugin's own section, that every name it uses (APIs, formats, architectures,
decoders, kernels) is registered by a loaded plugin, and that every model path exists. It prints
``OK`` or every problem, and exits 2 on a problem.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from mlxr_core.cli.commands import Subparsers

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.config.structure import Problem
    from mlxr_core.plugins import PluginHost

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
    from mlxr_core.config.loader import (
        ConfigProblems,
        config_error,
        load_config,
        validate_plugin_sections,
    )
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
    lines: list[str] = []
    try:
        validate_plugin_sections(config, host.registries)
    except ConfigProblems as exc:
        lines += exc.problems
    problems = [*unregistered_names(config, host), *missing_models(config)]
    if problems:
        lines += config_error(config, problems).problems
    if lines:
        raise ConfigProblems(lines)
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
    if server.get("api_keys"):  # never print secrets
        server["api_keys"] = ["***"] * len(server["api_keys"])
    print(yaml.safe_dump(shown, sort_keys=False), end="")
    return 0


def unregistered_names(config: Config, host: PluginHost) -> list[Problem]:
    """Names in ``config`` that no loaded plugin registered, with what is available."""
    from mlxr_core.config.structure import Problem
    from mlxr_core.errors import UnknownName
    from mlxr_core.kernels import kernel_preferences
    from mlxr_core.model.kv_storage import kv_cache_problems

    registries = host.registries
    problems = []

    def check(path: tuple[str | int, ...], what: str, name: str, available: list[str]) -> None:
        if name not in available:
            problems.append(Problem(path, str(UnknownName(what, name, available))))

    backends: dict[str, list[str]] = {}
    for name in registries.kernels.names():
        op, _, backend = name.partition(":")
        backends.setdefault(op, []).append(backend)

    def check_kernels(path: tuple[str | int, ...], choices: dict[str, str]) -> None:
        for op, backend in choices.items():
            if op not in backends:
                problems.append(Problem((*path, op), str(UnknownName("kernel op", op, backends))))
            else:
                for name in kernel_preferences(backend):
                    if name != "auto":
                        check((*path, op), f"{op} kernel backend", name, backends[op])

    for index, api in enumerate(config.apis):
        check(("apis", index), "API", api, registries.apis.names())
    check_kernels(("kernels",), config.kernels)
    for index, model in enumerate(config.models):
        where = ("models", index)
        if model.format != "auto":
            check((*where, "format"), "format", model.format, registries.formats.names())
        if model.arch != "auto" and model.arch not in fallback_model_types(host):
            names = [*registries.archs.names(), *registries.arch_fallbacks.names()]
            check((*where, "arch"), "architecture", model.arch, names)
        check((*where, "decoder"), "decoder", model.decoder, registries.decoders.names())
        check_kernels((*where, "kernels"), model.kernels)
    return [*problems, *kv_cache_problems(config, registries)]


def fallback_model_types(host: PluginHost) -> set[str]:
    """The model types the architecture fallbacks say they serve (the mlx-lm bridge's)."""
    return {name for entry in host.registries.arch_fallbacks for name in entry.meta.get("model_types") or ()}


def missing_models(config: Config) -> list[Problem]:
    """Model paths (and ``mmproj`` projector paths) that do not resolve to a file or folder."""
    from mlxr_core.config.structure import Problem
    from mlxr_core.errors import ModelLoadError
    from mlxr_core.model.paths import resolve_model_path

    problems = []
    for index, model in enumerate(config.models):
        paths = {"path": model.path}
        if model.mmproj is not None and model.mmproj.lower() != "none":
            paths["mmproj"] = model.mmproj
        for key, spec in paths.items():
            try:
                resolve_model_path(spec, join=False)  # a check writes nothing
            except ModelLoadError as exc:
                problems.append(Problem(("models", index, key), str(exc)))
    return problems
