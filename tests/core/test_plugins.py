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
