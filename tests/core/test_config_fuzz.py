"""Fuzzed server configs: whatever the YAML holds, loading ends in a ConfigError that names the key
(or the file and its YAML position), never in another exception."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxr_core.config.loader import load_config
from mlxr_core.errors import ConfigError

SECTIONS = ["models", "server", "engine", "sampling", "kernels", "apis", "plugins"]
KEYS = [
    *SECTIONS, "path", "name", "port", "host", "max_batch_size", "temperature", "prefix_cache",
    "max_bytes", "api_keys", "disable", "config", "dtype", "context_length", "max_tokens_cap",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(SECTIONS), values, max_size=5)
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def load_text(tmp_path: Path, data: bytes) -> Any:
    path = tmp_path / "server.yaml"
    path.write_bytes(data)
    return load_config(path, environ={})


@FUZZ
@given(document=documents)
def test_random_documents_load_or_name_the_key(tmp_path_factory: pytest.TempPathFactory, document: dict[str, Any]) -> None:
    tmp_path = tmp_path_factory.mktemp("cfg")
    try:
        load_text(tmp_path, yaml.safe_dump(document).encode())
    except ConfigError as exc:
        message = str(exc)
        assert "Traceback" not in message
        # Each problem names the file position or the key path it is about.
        assert "server.yaml" in message or any(section in message for section in SECTIONS), message


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_are_a_config_error(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    try:
        load_text(tmp_path_factory.mktemp("cfg"), data)
    except ConfigError as exc:
        assert "server.yaml" in str(exc) or any(section in str(exc) for section in SECTIONS)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (b"models:\n  - path: /m.gguf\n\xff\xfe: 1\n", "not UTF-8"),
        (b"models: [{path: /m.gguf}]\nengine: {max_batch_size: 100000000000000000000000000}\n", "engine.max_batch_size"),
        (b"models: [{path: /m.gguf}]\nserver: {port: [1, 2]}\n", "server.port"),
        (b"models: [{path: /m.gguf}]\nsampling: {temperature: .nan}\n", "sampling.temperature"),
        (b"models: [{path: /m.gguf}]\nengine: {unknown_knob: 1}\n", "engine.unknown_knob"),
        (b"models: [{path: /m.gguf}]\nserver: &a {x: *a}\n", "server"),
        (b"models: [{path: /m.gguf\n", "server.yaml:"),
        (b"[1, 2]\n", "mapping"),
    ],
)
def test_hostile_configs_name_the_key(tmp_path: Path, text: bytes, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_text(tmp_path, text)


def test_config_check_reports_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_bytes(b"models: [{path: 7}]\nengine: {max_batch_size: 1e400, prefix_cache: [1]}\n\xff: x\n")
    result = subprocess.run(
        [sys.executable, "-m", "mlxr_core.cli.main", "config", "check", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert "server.yaml" in result.stderr
    path.write_text("models: [{path: /m.gguf}]\nengine: {max_batch_size: abc}\n")
    result = subprocess.run(
        [sys.executable, "-m", "mlxr_core.cli.main", "config", "check", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "engine.max_batch_size" in result.stderr
