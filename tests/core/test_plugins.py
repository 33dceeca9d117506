"""The plugin core: isolated loading, enable/disable, strictness, requirements, attribution."""

from __future__ import annotations

import pytest

from mlxr_core.errors import PluginLoadError
from mlxr_core.plugins import hookimpl, load_plugins

GOOD = """
    from mlxr_core.plugins import hookimpl

    @hookimpl
    def mlxr_register_formats(register):
        register("goodfmt", "mlxr_test_good:Format")
"""
RAISES_AT_IMPORT = """
    raise RuntimeError("boom at import")
"""
RAISES_IN_HOOK = """
    from mlxr_core.plugins import hookimpl

    @hookimpl
    def mlxr_register_formats(register):
        register("halfway", "mlxr_test_hook:Format")

    @hookimpl
    def mlxr_register_archs(register):
        raise ValueError("boom in register")
"""


@pytest.fixture
def broken_and_good(fake_plugin_dist):
    fake_plugin_dist("mlxr-test-good", modules={"mlxr_test_good": GOOD}, entry_points={"good": "mlxr_test_good"})
    fake_plugin_dist(
        "mlxr-test-import", modules={"mlxr_test_import": RAISES_AT_IMPORT}, entry_points={"bad_import": "mlxr_test_import"}
    )
    fake_plugin_dist(
        "mlxr-test-hook", version="0.2.0", modules={"mlxr_test_hook": RAISES_IN_HOOK},
        entry_points={"bad_hook": "mlxr_test_hook"},
    )


def test_a_broken_plugin_is_marked_failed_and_the_others_keep_working(broken_and_good, monkeypatch):
    monkeypatch.delenv("MLXR_STRICT_PLUGINS", raising=False)
    host = load_plugins()
    plugins = host.plugins

    assert plugins["bad_import"].state == "failed"
    assert "import failed: RuntimeError: boom at import" in plugins["bad_import"].error
    assert "boom at import" in plugins["bad_import"].traceback
    assert plugins["bad_hook"].state == "failed"
    assert "mlxr_register_archs raised: ValueError: boom in register" in plugins["bad_hook"].error
    assert (plugins["bad_hook"].distribution, plugins["bad_hook"].version) == ("mlxr-test-hook", "0.2.0")
    # What the failed plugin registered before raising is rolled back.
    assert "halfway" not in host.registries.formats

    assert plugins["good"].state == "ok"
    assert host.registries.formats.entry("goodfmt").plugin == "good"
    assert plugins["good"].provides == {"formats": ["goodfmt"]}
    # The built-in plugins are found through the same entry-point group, unharmed.
    assert plugins["samplers"].state == "ok" and plugins["samplers"].distribution == "mlxr"
    assert {p.name for p in host.failed} == {"bad_import", "bad_hook"}


def test_strict_turns_the_first_failure_into_an_error(broken_and_good, monkeypatch):
    monkeypatch.setenv("MLXR_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=r"plugin '(bad_import|bad_hook)' failed"):
        load_plugins()
    monkeypatch.delenv("MLXR_STRICT_PLUGINS")
    with pytest.raises(PluginLoadError):
        load_plugins(strict=True)
    assert len(load_plugins().failed) == 2


class Formats:
    def __init__(self, *names: str, override: bool = False, fail: bool = False):
        self.names, self.override, self.fail = names, override, fail

    @hookimpl
    def mlxr_register_formats(self, register):
        for name in self.names:
            register(name, f"somewhere:{name}", override=self.override)
        if self.fail:
            raise RuntimeError("after overriding")


class Essential(Formats):
    MLXR_ESSENTIAL = True


def test_disable_by_name_and_by_environment_but_not_an_essential_plugin(monkeypatch):
    plugins = [("a", Formats("fa")), ("b", Formats("fb")), ("core", Essential("fc"))]
    monkeypatch.setenv("MLXR_DISABLE_PLUGINS", " b , core")
    host = load_plugins(disable=["a"], extra=plugins, discover=False)

    assert host.plugins["a"].state == "disabled"
    assert host.plugins["b"].state == "disabled"
    assert host.registries.formats.names() == ["fc"]
    assert host.plugins["core"].state == "ok" and host.plugins["core"].essential


def test_a_built_in_essential_plugin_refuses_to_be_disabled(monkeypatch):
    monkeypatch.setenv("MLXR_DISABLE_PLUGINS", "samplers")
    host = load_plugins()
    assert host.plugins["samplers"].state == "ok" and host.plugins["samplers"].essential
    assert "temperature" in host.registries.samplers


def test_require_fails_fast_naming_every_missing_or_mismatched_distribution(fake_plugin_dist):
    fake_plugin_dist("mlxr-test-old", version="0.1.0", entry_points={})
    with pytest.raises(PluginLoadError) as caught:
        load_plugins(require=["mlxr-test-old>=1.0", "mlxr-test-absent>=2", "mlxr>=0.1"])
    message = str(caught.value)
    assert "mlxr-test-old>=1.0 is required but mlxr-test-old 0.1.0 is installed" in message
    assert "mlxr-test-absent>=2 is required but mlxr-test-absent is not installed" in message
    assert "mlxr>=0.1" not in message
    with pytest.raises(PluginLoadError, match="not a valid requirement"):
        load_plugins(require=["mlxr >= = 1"])


def test_a_duplicate_name_is_an_error_naming_both_plugins():
    host = load_plugins(extra=[("first", Formats("gguf")), ("second", Formats("gguf"))], discover=False)
    assert host.plugins["first"].state == "ok"
    assert host.plugins["second"].state == "failed"
    assert "registered by both 'first' and 'second'" in host.plugins["second"].error
    assert host.registries.formats.entry("gguf").plugin == "first"

    with pytest.raises(PluginLoadError, match="registered by both"):
        load_plugins(extra=[("first", Formats("gguf")), ("second", Formats("gguf"))], discover=False, strict=True)


def test_an_explicit_override_replaces_and_is_attributed():
    host = load_plugins(
        extra=[("first", Formats("gguf")), ("second", Formats("gguf", override=True))], discover=False
    )
    entry = host.registries.formats.entry("gguf")
    assert entry.plugin == "second" and entry.override
    assert [old.plugin for old in entry.replaced] == ["first"]
    assert host.plugins["second"].provides == {"formats": ["gguf"]}
    assert host.plugins["first"].provides == {}  # what it registered is replaced


def test_an_override_loaded_before_the_plugin_it_replaces_still_wins():
    """Entry-point order is the installer's: a plain registration after an override slots under it."""
    host = load_plugins(
        extra=[("second", Formats("gguf", override=True)), ("first", Formats("gguf"))], discover=False
    )
    assert host.plugins["first"].state == host.plugins["second"].state == "ok"
    entry = host.registries.formats.entry("gguf")
    assert entry.plugin == "second" and [old.plugin for old in entry.replaced] == ["first"]
    assert host.plugins["second"].provides == {"formats": ["gguf"]}
    assert host.plugins["first"].provides == {}


def test_two_plain_claims_conflict_even_under_an_override():
    host = load_plugins(
        extra=[("over", Formats("gguf", override=True)), ("first", Formats("gguf")), ("third", Formats("gguf"))],
        discover=False,
    )
    assert host.plugins["third"].state == "failed"
    assert "registered by both 'first' and 'third'" in host.plugins["third"].error
    entry = host.registries.formats.entry("gguf")
    assert entry.plugin == "over" and [old.plugin for old in entry.replaced] == ["first"]


def test_removing_an_override_restores_what_it_replaced():
    from mlxr_core.registry import Registry

    registry = Registry("formats")
    registry.add("gguf", "a:x", plugin="over", override=True)
    registry.add("gguf", "a:y", plugin="base")
    registry.remove_plugin("over")
    assert registry.entry("gguf").plugin == "base" and registry.entry("gguf").replaced == []


def test_an_overriding_plugin_that_fails_gives_the_name_back():
    host = load_plugins(
        extra=[("first", Formats("gguf")), ("second", Formats("gguf", override=True, fail=True))],
        discover=False,
    )
    assert host.plugins["second"].state == "failed"
    assert host.registries.formats.entry("gguf").plugin == "first"


def test_config_sections_are_collected_per_plugin():
    import attrs

    @attrs.define
    class Section:
        level: int = 1

    class WithSection:
        @hookimpl
        def mlxr_config_sections(self, register):
            register(Section)

    host = load_plugins(extra=[("sectioned", WithSection())], discover=False)
    assert host.registries.config_sections == {"sectioned": Section}


def plugin_for_hook_api(version: str) -> str:
    return f"""
        from mlxr_core.plugins import hookimpl

        MLXR_HOOK_API = {version!r}

        @hookimpl
        def mlxr_register_formats(register):
            register("fmt_{version.replace('.', '_')}", "nowhere:Format")
    """


def test_a_plugin_built_for_a_newer_hook_api_is_refused_with_a_clear_message(fake_plugin_dist, capsys):
    import json

    from mlxr_core.cli.main import main
    from mlxr_core.hookspecs import HOOK_API_VERSION

    major = int(HOOK_API_VERSION.split(".")[0])
    fake_plugin_dist(
        "mlxr-test-future", modules={"mlxr_test_future": plugin_for_hook_api(f"{major + 1}")},
        entry_points={"future": "mlxr_test_future"},
    )
    fake_plugin_dist(
        "mlxr-test-today", modules={"mlxr_test_today": plugin_for_hook_api(f"{major}.x")},
        entry_points={"today": "mlxr_test_today"},
    )
    host = load_plugins(strict=False)
    future = host.plugins["future"]
    assert future.state == "failed" and future.hook_api == f"{major + 1}"
    assert future.error.startswith(
        f"incompatible: built for hook API {major + 1}, this mlxr provides {major}"
    )
    assert "upgrade mlxr" in future.error
    # Refused before registering anything: its hooks never ran.
    assert f"fmt_{major + 1}" not in host.registries.formats
    assert host.manager.get_plugin("future") is None
    assert host.plugins["today"].state == "ok" and f"fmt_{major}_x" in host.registries.formats

    assert main(["plugins", "--json"]) == 0
    report = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert report["future"]["state"] == "failed" and report["future"]["hook_api"] == f"{major + 1}"
    assert "built for hook API" in report["future"]["error"]
    assert main(["plugins", "--strict"]) == 1
    assert "future" in capsys.readouterr().err
    with pytest.raises(PluginLoadError, match=rf"plugin 'future' failed: incompatible: built for hook API {major + 1}"):
        load_plugins(strict=True)


@pytest.mark.parametrize(
    ("declared", "error"),
    [
        (None, None),
        ("1", None),
        (1, None),
        ("1.x", None),
        ("1.0", None),
        ("1.7", "built for hook API 1.7, this mlxr provides 1.0; upgrade mlxr"),
        ("0", "built for hook API 0, this mlxr provides 1 (hook API 1.0); upgrade the plugin"),
        ("2.1", "built for hook API 2, this mlxr provides 1"),
        ("one", "MLXR_HOOK_API = 'one' is not a hook API version"),
        (True, "is not a hook API version"),
    ],
)
def test_hook_api_declarations(declared, error, monkeypatch):
    from mlxr_core import hookspecs
    from mlxr_core.plugins import check_hook_api

    monkeypatch.setattr(hookspecs, "HOOK_API_VERSION", "1.0")
    if error is None:
        check_hook_api(declared)
    else:
        with pytest.raises(PluginLoadError) as caught:
            check_hook_api(declared)
        assert error in str(caught.value)


def test_trace_hooks_logs_every_hook_call(monkeypatch, caplog):
    import logging

    class Observer(Formats):
        @hookimpl
        def mlxr_engine_started(self, engine):
            pass

    monkeypatch.setenv("MLXR_TRACE_HOOKS", "1")
    with caplog.at_level(logging.INFO, logger="mlxr_core.plugins"):
        host = load_plugins(extra=[("traced", Observer("tf"))], discover=False)
        host.notify("mlxr_engine_started", engine="the-engine")
    calls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hook call:")]
    assert any(m.startswith("hook call: traced.mlxr_register_formats(register=") for m in calls)
    assert "hook call: traced.mlxr_engine_started(engine='the-engine')" in calls
    assert sum(r.getMessage().startswith("hook done: traced.") for r in caplog.records) == 2

    caplog.clear()
    monkeypatch.delenv("MLXR_TRACE_HOOKS")
    with caplog.at_level(logging.INFO, logger="mlxr_core.plugins"):
        load_plugins(extra=[("traced", Observer("tf"))], discover=False)
    assert not [r for r in caplog.records if r.getMessage().startswith("hook ")]
