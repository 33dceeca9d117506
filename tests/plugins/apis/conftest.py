"""Fixtures shared by the API plugin tests: the real engine on a tiny random GGUF model; the fake
MCP server over streamable HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny-api") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_app(tiny_model_path: Path) -> Iterator[TestClient]:
    """Every built-in API over the real engine serving the tiny model as ``tiny`` (context 128)."""
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=128)],
        apis=["openai", "ollama", "anthropic"],
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
            yield client
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def mcp_http_url() -> Iterator[str]:
    """The fake MCP server (``fake_mcp_server.py``, mode ``ok``) over streamable HTTP: its URL."""
    from scripted_mcp import http_mcp_server

    with http_mcp_server() as url:
        yield url
