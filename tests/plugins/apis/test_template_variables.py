"""Chat template variables per request in every API, over the model's: OpenAI's and vLLM's
``chat_template_kwargs`` and ``reasoning_effort``, Anthropic's ``thinking.type`` and Ollama's
``think`` (false, or an effort), each reaching the template (a scripted engine whose template
writes the variables it is given)."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, plugin_host

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app


def client_for(fake: FakeEngine, model_variables: dict[str, Any]) -> TestClient:
    config = Config(models=[ModelConfig(path="unused", chat_template_kwargs=model_variables)],
                    apis=["openai", "ollama", "anthropic"])  # fmt: skip
    return TestClient(build_app(ServerContext(config=config, host=plugin_host(), engine=fake)))


def prompt_of(fake: FakeEngine) -> str:
    return bytes(fake.requests[-1].prompt_ids).decode()


TURN = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/chat/completions", {"messages": TURN, "chat_template_kwargs": {"enable_thinking": False}}, "[enable_thinking=False]"),
    ("/v1/chat/completions", {"messages": TURN, "reasoning_effort": "high"}, "[reasoning_effort=high]"),
    ("/v1/chat/completions", {"messages": TURN, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
     "[reasoning_effort=high]"),
    ("/v1/responses", {"input": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "[enable_thinking=False]"),
    ("/v1/messages", {"messages": TURN, "max_tokens": 4, "thinking": {"type": "disabled"}}, "[enable_thinking=False]"),
    ("/v1/messages", {"messages": TURN, "max_tokens": 4, "chat_template_kwargs": {"x": 1}}, "[x=1]"),
    ("/api/chat", {"messages": TURN, "stream": False, "think": False}, "[enable_thinking=False]"),
    ("/api/chat", {"messages": TURN, "stream": False, "chat_template_kwargs": {"x": 2}}, "[x=2]"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "written"), CASES)
def test_a_requests_variables_reach_the_template(path: str, body: dict[str, Any], written: str) -> None:
    fake = FakeEngine()
    with client_for(fake, {}) as client:
        r = client.post(path, json={"model": "fake", **body})
        assert r.status_code == 200, r.text
    assert prompt_of(fake) == f"<user>hi{written}<assistant>"


def test_the_models_variables_hold_unless_a_request_overrides_them() -> None:
    fake = FakeEngine()
    with client_for(fake, {"enable_thinking": False, "x": 0}) as client:
        client.post("/v1/chat/completions", json={"model": "fake", "messages": TURN})
        assert prompt_of(fake) == "<user>hi[enable_thinking=False][x=0]<assistant>"
        client.post("/v1/chat/completions", json={"model": "fake", "messages": TURN, "chat_template_kwargs": {"x": 5}})
        assert prompt_of(fake) == "<user>hi[enable_thinking=False][x=5]<assistant>"
        r = client.post("/v1/chat/completions", json={"model": "fake", "messages": TURN, "chat_template_kwargs": {"tools": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
