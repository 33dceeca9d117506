"""Embeddings and model names through every API, over the real engine serving two tiny models
(the same random GGUF under two names, each with aliases) from one process."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from litestar.testing import TestClient

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.embedding import embed_tokens
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

CONTEXT = 32
NAMES = {"first": ["one", "uno"], "second": ["two"]}


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Iterator[TestClient]:
    models = [
        ModelConfig(path=str(tiny_model_path), name=name, aliases=aliases, context_length=CONTEXT)
        for name, aliases in NAMES.items()
    ]
    config = Config(models=models, apis=["openai", "ollama", "anthropic"])
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as test_client:
            yield test_client
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Path) -> Any:
    """A copy of the model in this thread, for expected vectors."""
    return load_model(ModelConfig(path=str(tiny_model_path), dtype="float32"), load_plugins().registries)


def expected(loaded: Any, text: str) -> list[float]:
    (vector,) = embed_tokens(loaded, [loaded.tokenizer.encode(text)], chunk=512)
    return vector


# -- OpenAI ----------------------------------------------------------------------------------


def test_openai_embeddings_of_strings_and_token_ids(client: TestClient, loaded: Any) -> None:
    r = client.post("/v1/embeddings", json={"model": "uno", "input": ["the cat", "a dog sat"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "uno"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    for item, text in zip(body["data"], ["the cat", "a dog sat"], strict=True):
        np.testing.assert_allclose(item["embedding"], expected(loaded, text), atol=1e-5)
    tokens = sum(len(loaded.tokenizer.encode(t)) for t in ["the cat", "a dog sat"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    ids = loaded.tokenizer.encode("the cat")
    one = client.post("/v1/embeddings", json={"model": "first", "input": "the cat"}).json()
    by_ids = client.post("/v1/embeddings", json={"model": "two", "input": ids}).json()
    by_id_lists = client.post("/v1/embeddings", json={"model": "second", "input": [ids, ids[:2]]}).json()
    assert len(by_id_lists["data"]) == 2
    for other in (by_ids["data"][0], by_id_lists["data"][0]):
        np.testing.assert_allclose(other["embedding"], one["data"][0]["embedding"], atol=1e-6)


def test_openai_base64_encoding_is_little_endian_float32(client: TestClient) -> None:
    floats = client.post("/v1/embeddings", json={"model": "one", "input": "hello"}).json()
    packed = client.post("/v1/embeddings", json={"model": "one", "input": "hello", "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    np.testing.assert_allclose(vector, floats["data"][0]["embedding"], atol=1e-7)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"model": "one", "input": "x", "dimensions": 8}, 400, "dimensions", "not supported"),
        ({"model": "nope", "input": "x"}, 404, "model", "does not exist"),
        ({"model": "one", "input": []}, 400, "input", "must not be empty"),
        ({"model": "one", "input": ""}, 400, "input", "empty string"),
        ({"model": "one", "input": [1, "a"]}, 400, "input", "list of strings"),
        ({"model": "one", "input": [[1], []]}, 400, "input", "list of strings"),
        ({"model": "one", "input": [10**6]}, 400, "input", "token ids must be in"),
        ({"model": "one", "input": list(range(1, CONTEXT + 2))}, 400, "input", "context length"),
        ({"model": "one", "input": "x", "encoding_format": "int8"}, 400, "encoding_format", "int8"),
        ({"model": "one", "input": 5}, 400, "input", "Expected"),
    ],
)
def test_openai_embedding_errors_in_openai_shape(
    client: TestClient, body: dict[str, Any], status: int, param: str, words: str
) -> None:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_openai_models_lists_both_and_retrieves_by_name_or_alias(client: TestClient) -> None:
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["first", "second"]
    for name, aliases in NAMES.items():
        for asked in (name, *aliases):
            r = client.get(f"/v1/models/{asked}")
            assert r.status_code == 200 and r.json()["id"] == name
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"


@pytest.mark.parametrize("model", ["first", "one", "uno", "second", "two"])
def test_openai_chat_reaches_each_model_by_name_and_alias(client: TestClient, model: str) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model


# -- Ollama ----------------------------------------------------------------------------------


def test_ollama_embed(client: TestClient, loaded: Any) -> None:
    r = client.post("/api/embed", json={"model": "two", "input": ["the cat", "a dog sat"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "second" and len(body["embeddings"]) == 2
    np.testing.assert_allclose(body["embeddings"][1], expected(loaded, "a dog sat"), atol=1e-5)
    assert body["prompt_eval_count"] == sum(len(loaded.tokenizer.encode(t)) for t in ["the cat", "a dog sat"])
    assert body["total_duration"] >= body["load_duration"] >= 0

    single = client.post("/api/embed", json={"model": "uno:latest", "input": "the cat"}).json()
    np.testing.assert_allclose(single["embeddings"][0], body["embeddings"][0], atol=1e-6)
    assert client.post("/api/embed", json={"model": "one", "input": []}).json()["embeddings"] == []


def test_ollama_embed_truncates_long_input_unless_told_not_to(client: TestClient) -> None:
    long = "the cat sat on the mat " * 20
    cut = client.post("/api/embed", json={"model": "one", "input": long})
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == CONTEXT
    refused = client.post("/api/embed", json={"model": "one", "input": long, "truncate": False})
    assert refused.status_code == 400 and "context length" in refused.json()["error"]


def test_ollama_legacy_embeddings(client: TestClient, loaded: Any) -> None:
    r = client.post("/api/embeddings", json={"model": "first", "prompt": "the cat"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embedding"], expected(loaded, "the cat"), atol=1e-5)
    assert client.post("/api/embeddings", json={"model": "first", "prompt": ""}).json() == {"embedding": []}


def test_ollama_lists_both_and_chats_by_alias(client: TestClient) -> None:
    assert [m["name"] for m in client.get("/api/tags").json()["models"]] == ["first", "second"]
    assert [m["name"] for m in client.get("/api/ps").json()["models"]] == ["first", "second"]
    for model, served in (("uno", "first"), ("two:latest", "second")):
        r = client.post(
            "/api/chat",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                  "options": {"num_predict": 2, "temperature": 0}},
        )
        assert r.status_code == 200 and r.json()["model"] == served
    missing = client.post("/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 404 and "not found" in missing.json()["error"]


# -- Anthropic and /health -------------------------------------------------------------------


@pytest.mark.parametrize("model", ["second", "two", "one"])
def test_anthropic_messages_by_name_and_alias(client: TestClient, model: str) -> None:
    r = client.post(
        "/v1/messages",
        json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200, r.text
    missing = client.post(
        "/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert missing.status_code == 404 and missing.json()["type"] == "error"


def test_health_lists_both_models(client: TestClient) -> None:
    body = client.get("/health").json()
    assert body["models"] == ["first", "second"]


def test_a_client_that_leaves_cancels_the_embedding_it_waits_for() -> None:
    """What the embedding routes wait through: the work is cancelled when the client disconnects
    (Engine.embed_async then stops its job before the next forward pass)."""
    import asyncio

    from mlxr_core.http.frontend import ClientDisconnected, unless_disconnected

    class LeavingClient:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    cancelled = []

    async def embedding() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "vectors"

    async def scenario() -> None:
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(LeavingClient(), embedding())  # type: ignore[arg-type]
        assert await unless_disconnected(LeavingClient(), asyncio.sleep(0, "done")) == "done"  # type: ignore[arg-type]

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert cancelled == [True]


def test_ollama_embed_options_follow_the_generation_rules(client: TestClient) -> None:
    """options are unused by an embedding, but a body the document refuses is a 400 naming the
    option there too (schemathesis found /api/embed answering 200 to a 300-character stop)."""
    bad = {"stop": "x" * 300}
    for path, body in (("/api/embed", {"model": "one", "input": "the cat"}), ("/api/embeddings", {"model": "one", "prompt": "the cat"})):
        r = client.post(path, json={**body, "options": bad})
        assert r.status_code == 400 and "options.stop" in r.text, r.text
        assert client.post(path, json={**body, "options": {"stop": ["</s>"], "temperature": 0.2}}).status_code == 200
