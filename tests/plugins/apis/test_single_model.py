"""Clients written for single-model servers: a request without ``model`` goes to
``server.default_model`` (or, with ``server.model_optional``, to the one model served) in every
API, and the OpenAI routes answer without ``/v1`` too (``/chat/completions``, ``/models`` ...),
as mlx-lm's and llama.cpp's servers do, listed in the OpenAPI document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, make_ctx

from mlxr_core.config.schema import ResponsesStoreConfig, ServerConfig
from mlxr_core.http.server import build_app

TURN = [{"role": "user", "content": "hi"}]
NO_MODEL = [
    ("/v1/chat/completions", {"messages": TURN, "max_tokens": 2}),
    ("/chat/completions", {"messages": TURN, "max_tokens": 2}),
    ("/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/messages", {"messages": TURN, "max_tokens": 2}),
    ("/api/chat", {"messages": TURN, "stream": False, "options": {"num_predict": 2}}),
    ("/responses", {"input": "hi", "max_output_tokens": 2}),
]


def client(tmp_path: Path, **server: Any) -> TestClient:
    store = ResponsesStoreConfig(path=str(tmp_path / "r.sqlite3"))
    return TestClient(build_app(make_ctx(FakeEngine(), server=ServerConfig(responses_store=store, **server))))


@pytest.mark.parametrize(("path", "body"), NO_MODEL)
@pytest.mark.parametrize("setting", [{"default_model": "fake"}, {"model_optional": True}])
def test_a_request_without_model_goes_to_the_default(tmp_path: Path, path: str, body: dict[str, Any], setting: dict[str, Any]) -> None:
    with client(tmp_path, **setting) as c:
        for sent in (body, {**body, "model": None}):  # absent or null alike (llama.cpp's server tests)
            r = c.post(path, json=sent)
            assert r.status_code == 200, r.text
            assert c.app.state["mlxr"].engine.requests[-1].model == "fake"


@pytest.mark.parametrize(("path", "body"), NO_MODEL)
def test_without_a_default_a_missing_model_is_refused_naming_it(tmp_path: Path, path: str, body: dict[str, Any]) -> None:
    with client(tmp_path) as c:
        for sent in (body, {**body, "model": None}):
            r = c.post(path, json=sent)
            assert r.status_code == 400 and "model" in r.text


def test_a_named_model_is_kept_and_an_unknown_default_is_a_404(tmp_path: Path) -> None:
    with client(tmp_path, default_model="elsewhere") as c:
        assert c.post("/chat/completions", json={"model": "fake", "messages": TURN, "max_tokens": 2}).status_code == 200
        r = c.post("/chat/completions", json={"messages": TURN})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_the_unprefixed_routes_answer_and_are_documented(tmp_path: Path) -> None:
    with client(tmp_path) as c:
        assert c.get("/models").json() == c.get("/v1/models").json()
        assert c.get("/models/fake").json()["id"] == "fake"
        r = c.post("/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hel"
        documented = c.get("/schema/openapi.json").json()["paths"]
        for path in ("/chat/completions", "/completions", "/models", "/embeddings", "/responses"):
            assert path in documented and f"/v1{path}" in documented
