"""Thinking budgets: past its budget of reasoning tokens, a reply's end-of-thinking marker is
forced and the answer follows; through the engine on a tiny model whose template opens a
``<think>`` block, and through the Anthropic, chat completions and Responses APIs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import pytest
from litestar.testing import TestClient

from mlxr_core.chat.thinking import THINKING_BUDGET
from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import CHATML_TEMPLATE, write_tiny_llama_gguf
from mlxr_plugins.samplers.thinking import ThinkingBudget

#: ChatML whose generation prompt opens the thinking block (as Qwen3's does with thinking on).
THINKING_TEMPLATE = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
START, END = [7, 8], [9, 10, 11]


def forced(budget: ThinkingBudget, vocab: int = 16) -> int | None:
    """The token ``budget`` forces next (None: it leaves the logits alone)."""
    out = budget(mx.zeros((1, vocab)))
    allowed = [i for i in range(vocab) if out[0, i].item() > -float("inf")]
    return allowed[0] if len(allowed) == 1 else None


def test_the_end_marker_is_forced_after_the_budget_then_nothing() -> None:
    budget = ThinkingBudget(3, START, END, opened=True)
    for token in (1, 2, 3):
        assert forced(budget) is None and budget.valid_prefix([1, 2, 3, 4]) == 3 - budget.spent
        budget.accept(token)
    for token in END:
        assert forced(budget) == token and budget.valid_prefix([token]) == 0
        budget.accept(token)
    for token in (4, *START, 5):  # the answer: never forced again, a start marker is text
        assert forced(budget) is None
        budget.accept(token)


def test_the_block_starts_where_the_reply_opens_it_and_may_end_early() -> None:
    budget = ThinkingBudget(0, START, END, opened=False)
    budget.accept(1)
    assert forced(budget) is None
    budget.accept(START[0])
    budget.accept(START[1])
    assert forced(budget) == END[0]
    early = ThinkingBudget(10, START, END, opened=True)
    for token in [1, *END, 2, 3]:
        assert forced(early) is None
        early.accept(token)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("think") / "think.gguf", chat_template=THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def served(thinking_model: Path) -> Iterator[tuple[Engine, TestClient]]:
    config = Config(
        models=[ModelConfig(path=str(thinking_model), name="think"), ModelConfig(
            path=str(thinking_model), name="think-3", thinking_budget=3), ModelConfig(
            path=str(thinking_model), name="no-think", reasoning_parser="none")],
        apis=["openai", "anthropic"],
    )  # fmt: skip
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
            yield engine, client
    finally:
        engine.stop()


def greedy(engine: Engine, prompt: list[int], budget: dict[str, Any] | None) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, extra={THINKING_BUDGET: budget} if budget else {})
    ids: list[int] = []
    for event in engine.submit(GenerationRequest(model="think", prompt_ids=prompt, params=params)):
        if isinstance(event, Delta):
            ids += event.token_ids
    return ids


def test_the_engine_forces_the_marker_and_goes_on(served: tuple[Engine, TestClient]) -> None:
    engine, _ = served
    tokenizer = engine.model("think").tokenizer
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    free = greedy(engine, prompt, None)
    bounded = greedy(engine, prompt, {"tokens": 4, "start": "<think>", "end": "</think>", "opened": True})
    assert free[: len(end) + 4] != free[:4] + end  # the model would not have closed the block there
    assert bounded[:4] == free[:4] and bounded[4 : 4 + len(end)] == end
    assert len(bounded) == 12  # the answer goes on after the marker


def test_anthropic_budget_tokens(served: tuple[Engine, TestClient]) -> None:
    _, client = served
    body = {"model": "think", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    bounded = client.post("/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 2}}).json()
    free = client.post("/v1/messages", json={**body, "thinking": {"type": "enabled"}}).json()
    assert [block["type"] for block in free["content"]] == ["thinking"]  # thinks to the end of max_tokens
    assert [block["type"] for block in bounded["content"]] == ["thinking", "text"]
    assert free["content"][0]["thinking"].startswith(bounded["content"][0]["thinking"])
    bad = client.post("/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": -1}})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_the_models_default_and_the_requests_effort(served: tuple[Engine, TestClient]) -> None:
    _, client = served
    chat = {"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    message = client.post("/v1/chat/completions", json={**chat, "model": "think-3"}).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    # An effort's budget (minimal: 256) is over the default and over max_tokens: no answer yet.
    message = client.post("/v1/chat/completions", json={**chat, "model": "think-3", "reasoning_effort": "minimal"}).json()
    assert message["choices"][0]["message"]["reasoning_content"] and not message["choices"][0]["message"]["content"]
    response = client.post("/v1/responses", json={"model": "think-3", "input": "hi", "max_output_tokens": 12,
                                                  "temperature": 0, "store": False}).json()  # fmt: skip
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert 0 < response["usage"]["output_tokens_details"]["reasoning_tokens"] < 12


def test_chat_usage_counts_the_reasoning_tokens_streamed_or_not(served: tuple[Engine, TestClient]) -> None:
    """``completion_tokens_details.reasoning_tokens``: the reasoning's tokens, streamed or not, n
    choices summed; what the Responses API reports for the same reply."""
    engine, client = served
    chat = {"model": "think-3", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    reply = client.post("/v1/chat/completions", json=chat).json()
    reasoning = reply["choices"][0]["message"]["reasoning_content"]
    tokens = len(engine.model("think-3").tokenizer.encode(reasoning, add_special_tokens=False))
    assert 0 < tokens < reply["usage"]["completion_tokens"]
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == tokens
    two = client.post("/v1/chat/completions", json={**chat, "n": 2}).json()
    assert two["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * tokens
    stream = {**chat, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=stream) as events:
        lines = [line for line in events.iter_lines() if line.startswith("data: {")]
    assert msgspec.json.decode(lines[-1][6:])["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * tokens
    response = client.post("/v1/responses", json={"model": "think-3", "input": "hi", "max_output_tokens": 12,
                                                  "temperature": 0, "store": False}).json()  # fmt: skip
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens
    # a model without a reasoning parser says nothing of reasoning
    plain = client.post("/v1/chat/completions", json={**chat, "model": "no-think"}).json()
    assert plain["choices"][0]["message"]["content"] and "completion_tokens_details" not in plain["usage"]
