"""KV cache methods as plugins: a ``kv_cache`` setting no method takes is refused before any model
loads, naming the key and its line; the registered methods are listed per plugin."""

from __future__ import annotations

import pytest

from mlxr_core.config.loader import ConfigProblems, load_config
from mlxr_core.model.kv_storage import validate_kv_cache_choices
from mlxr_core.plugins import load_plugins


@pytest.fixture(scope="module")
def host():
    return load_plugins()


def refused(tmp_path, host, kv_cache: str) -> list[str]:
    path = tmp_path / "server.yaml"
    path.write_text(f"models:\n  - path: /models/a.gguf\n    kv_cache: {kv_cache}\n")
    config = load_config(path, environ={})
    with pytest.raises(ConfigProblems) as caught:
        validate_kv_cache_choices(config, host.registries)
    return caught.value.problems


def test_the_built_in_methods_come_from_the_kv_caches_plugin(host):
    assert host.registries.kv_caches.by_plugin("kv_caches") == ["affine", "turboquant", "turboquant_mse"]


@pytest.mark.parametrize(
    ("kv_cache", "key", "message"),
    [
        (
            "{method: turboquant2, bits: 3}",
            "method",
            "unknown KV cache method 'turboquant2' (available: affine, turboquant, turboquant_mse); did you mean turboquant or turboquant_mse?",
        ),
        ("{bits: 3}", "bits", "the affine method takes 8 or 4, got 3"),
        ("{bits: 4, window: 64}", "window", "the affine method keeps no recent-token window"),
        ("{method: turboquant, bits: 8}", "bits", "the turboquant method takes 4, 3 or 2, got 8"),
        (
            "{method: turboquant, bits: 3, group_size: 32}",
            "group_size",
            "the turboquant method has no groups",
        ),
        (
            "{method: turboquant, bits: 3, start_after: 16}",
            "start_after",
            "the turboquant method keeps the most recent",
        ),
    ],
    ids=[
        "unknown-method",
        "affine-bits",
        "affine-window",
        "turboquant-bits",
        "turboquant-group",
        "turboquant-start",
    ],
)
def test_a_setting_no_method_takes_names_its_key_and_line(tmp_path, host, kv_cache, key, message):
    (problem,) = refused(tmp_path, host, kv_cache)
    assert problem.startswith(
        f"{tmp_path / 'server.yaml'}:3: models[0].kv_cache.{key}: {message}"
    ), problem


def test_bits_outside_every_method_is_a_load_error(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(
        "models:\n  - path: /models/a.gguf\n    kv_cache: {method: turboquant, bits: 5}\n"
    )
    with pytest.raises(ConfigProblems) as caught:
        load_config(path, environ={})
    assert caught.value.problems == [f"{path}:3: models[0].kv_cache.bits: must be one of 8, 4, 3, 2, got 5"]
