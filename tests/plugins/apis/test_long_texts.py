"""Texts just under the character bound but far over the context in tokens (the characters of CJK
are a token each or more): refused by every route that tokenizes text after tokenizing a head of
it, never all of it, and long bodies prepared on a few threads of their own, so that many of them
cannot hold the worker threads every other request is prepared on."""

from __future__ import annotations

import random
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from litestar.testing import TestClient

from mlxr_core.config.schema import Config, ModelConfig, ResponsesStoreConfig, ServerConfig
from mlxr_core.engine.engine import Engine, ModelInfo
from mlxr_core.http import frontend
from mlxr_core.http.context import LONG_BODY_THREADS, ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.model.tokenizer import HEAD_MARGIN
from mlxr_core.plugins import load_plugins

CONTEXT = 1024


@pytest.fixture(scope="module")
def served(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, ModelInfo]]:
    store = ResponsesStoreConfig(path=str(tmp_path_factory.mktemp("store") / "responses.sqlite3"))
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=CONTEXT)],
        apis=["openai", "ollama", "anthropic", "rerank"],
        server=ServerConfig(max_tokens_cap=2, access_log=False, responses_store=store),
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
            yield client, engine.model("tiny")
    finally:
        engine.stop()


@pytest.fixture
def counted(served: tuple[TestClient, ModelInfo], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters each call of the served model's tokenizer was given."""
    tokenizer = served[1].tokenizer
    encode = tokenizer.encode
    calls: list[int] = []

    def counting(text: str, **kwargs: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return calls


def cjk(n: int) -> str:
    rng = random.Random(7)
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(n))


def long_text(info: ModelInfo) -> str:
    """CJK just under the character bound (the context times the longest token's length), as the
    attack sent: some 3 tokens a character in this vocabulary."""
    return cjk(CONTEXT * info.longest_token_bytes - 600)


USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}
# Each route that tokenizes a text a client sends, and a body putting ``text`` where it tokenizes.
ROUTES: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "chat": ("/v1/chat/completions", lambda t: {"model": "tiny", "messages": [{"role": "user", "content": t}]}),
    "chat_tools": ("/v1/chat/completions", lambda t: {
        "model": "tiny", "messages": USER,
        "tools": [{**TOOL, "function": {**TOOL["function"], "description": t}}],
    }),
    "completions": ("/v1/completions", lambda t: {"model": "tiny", "prompt": t}),
    "tokenize_prompt": ("/tokenize", lambda t: {"model": "tiny", "prompt": t}),
    "tokenize_messages": ("/tokenize", lambda t: {"model": "tiny", "messages": [{"role": "user", "content": t}]}),
    "embeddings": ("/v1/embeddings", lambda t: {"model": "tiny", "input": t}),
    "rerank": ("/v1/rerank", lambda t: {"model": "tiny", "query": "q", "documents": [t]}),
    "score": ("/score", lambda t: {"model": "tiny", "text_1": t, "text_2": "b"}),
    "anthropic_system": ("/v1/messages", lambda t: {"model": "tiny", "max_tokens": 2, "system": t, "messages": USER}),
    "anthropic_count": ("/v1/messages/count_tokens", lambda t: {"model": "tiny", "system": t, "messages": USER}),
    "responses_input": ("/v1/responses", lambda t: {"model": "tiny", "input": t}),
    "responses_instructions": ("/v1/responses", lambda t: {"model": "tiny", "input": "hi", "instructions": t}),
    "ollama_chat": ("/api/chat", lambda t: {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": t}]}),
    "ollama_generate": ("/api/generate", lambda t: {"model": "tiny", "stream": False, "prompt": t}),
    "ollama_embed": ("/api/embed", lambda t: {"model": "tiny", "input": t, "truncate": False}),
}  # fmt: skip
#: Characters a route may have tokenized for the long text: about three times the context's worth
#: (:func:`~mlxr_core.model.tokenizer.encode_within`) and its template's few.
BOUND = 3 * (CONTEXT + HEAD_MARGIN) + 400


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_text_far_over_the_context_is_refused_from_a_head_of_it(
    served: tuple[TestClient, ModelInfo], counted: list[int], route: str
) -> None:
    client, info = served
    text = long_text(info)
    assert len(text) < CONTEXT * info.longest_token_bytes  # the character bound lets it through
    path, body = ROUTES[route]
    response = client.post(path, json=body(text))
    assert response.status_code == 400, response.text[:300]
    assert "context length" in response.text, response.text[:300]
    assert sum(counted) <= BOUND, (sum(counted), len(text))  # before: the whole text, 3 tokens a character


@pytest.mark.parametrize("route", ["ollama_embed_truncated", "ollama_embeddings"])
def test_an_embedding_of_a_truncated_text_tokenizes_a_head_of_it(
    served: tuple[TestClient, ModelInfo], counted: list[int], route: str
) -> None:
    client, info = served
    text = long_text(info)
    if route == "ollama_embed_truncated":
        response = client.post("/api/embed", json={"model": "tiny", "input": text})
        assert response.status_code == 200 and response.json()["prompt_eval_count"] == CONTEXT, response.text[:300]
    else:
        response = client.post("/api/embeddings", json={"model": "tiny", "prompt": text})
        assert response.status_code == 200 and response.json()["embedding"], response.text[:300]
    assert sum(counted) <= BOUND, sum(counted)


def test_tokenize_answers_at_most_the_context(served: tuple[TestClient, ModelInfo]) -> None:
    """/tokenize of a text over the context by one token is refused, not answered with its ids."""
    client, _ = served
    fits = client.post("/tokenize", json={"model": "tiny", "prompt": "x" * CONTEXT, "add_special_tokens": False})
    assert fits.status_code == 200 and fits.json()["count"] == CONTEXT, fits.text[:300]
    over = client.post("/tokenize", json={"model": "tiny", "prompt": "x" * (CONTEXT + 1), "add_special_tokens": False})
    assert over.status_code == 400 and "context length" in over.json()["error"]["message"], over.text[:300]


class Body:
    """The part of a request :func:`frontend.prepare_in_thread` reads: its body."""

    def __init__(self, size: int) -> None:
        self.size = size

    async def body(self) -> bytes:
        return b" " * self.size


def test_long_bodies_wait_for_their_own_threads_and_leave_the_others_free() -> None:
    """Fifty long bodies whose preparation blocks (more than the 40 shared worker threads) hold the
    few threads for long bodies, and wait for them, while a short body is prepared at once."""
    ctx = types.SimpleNamespace(long_bodies=attrs.fields(ServerContext).long_bodies.default.factory())
    release = threading.Event()
    started = 0

    def slow() -> str:
        nonlocal started
        started += 1
        release.wait(10)
        return "long"

    async def run() -> tuple[int, int, str, list[str]]:
        results: list[str] = []

        async def long_one() -> None:
            results.append(await frontend.prepare_in_thread(ctx, Body(frontend.LONG_BODY_BYTES + 1), slow))  # type: ignore[arg-type]

        async with anyio.create_task_group() as group:
            for _ in range(50):
                group.start_soon(long_one)
            await anyio.sleep(0.3)
            running, borrowed = started, ctx.long_bodies.borrowed_tokens
            with anyio.fail_after(5):
                short = await frontend.prepare_in_thread(ctx, Body(100), lambda: "short")  # type: ignore[arg-type]
            release.set()
        return running, int(borrowed), short, results

    running, borrowed, short, results = anyio.run(run)
    assert running == borrowed == LONG_BODY_THREADS
    assert short == "short" and results == ["long"] * 50
