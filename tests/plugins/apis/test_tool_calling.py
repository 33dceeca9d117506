"""Tool calls and reasoning through the OpenAI API, over a scripted engine that replies with the
markup a model would write (the parsing itself is tested in tests/plugins/parsers)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import openai
import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, FakeTokenizer, ThreadedServer, make_ctx

from mlxr_core.chat.parsing import validate_parser_choices
from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.errors import ConfigError
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class ChatMLTokenizer(FakeTokenizer):
    """A ChatML model that thinks: ``auto`` picks ``hermes`` and ``think``; the template renders no
    tools, so they go into the system prompt."""

    chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %} <think>"


@pytest.fixture
def fake() -> FakeEngine:
    engine = FakeEngine(context_length=4096)
    engine.models["fake"] = attrs.evolve(engine.models["fake"], tokenizer=ChatMLTokenizer())
    return engine


@pytest.fixture
def client(fake: FakeEngine):
    with TestClient(build_app(make_ctx(fake))) as test_client:
        yield test_client


def prompt_of(fake: FakeEngine) -> str:
    return bytes(fake.requests[-1].prompt_ids).decode()


def test_a_call_after_thinking_becomes_tool_calls(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "<think>The user wants weather.</think>\n" + CALL
    body = {"model": "fake", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 500}
    reply = client.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == "The user wants weather."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # The template renders no tools: their definitions went into the system prompt.
    prompt = prompt_of(fake)
    assert prompt.startswith("<system>") and '"name": "get_weather"' in prompt


def test_history_with_calls_and_results_is_rendered_in_the_parsers_format(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "It is sunny."
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    body = {"model": "fake", "messages": messages, "tools": [WEATHER], "max_tokens": 500}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert reply["choices"][0]["finish_reason"] == "stop"
    prompt = prompt_of(fake)
    assert '<assistant><tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in prompt
    assert "<user><tool_response>\nsunny, 21C\n</tool_response>" in prompt


def test_streamed_calls_arrive_as_openai_deltas_and_no_markup_leaks(fake: FakeEngine) -> None:
    fake.REPLY = "<think>Let me check.</think>Checking. " + CALL
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],  # type: ignore[list-item]
            max_tokens=500, stream=True,
        )
        chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert content == "Checking. " and reasoning == "Let me check."
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls[0].index == 0 and calls[0].id and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_malformed_markup_is_plain_content(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "<tool_call>{oops}</tool_call>"
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 500}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == fake.REPLY
    assert "tool_calls" not in reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_a_call_to_a_tool_not_offered_stays_text(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 500}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "tool_calls" not in message and "rm_rf" in message["content"]


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", ["get_weather", "get_time"]), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])],
)
def test_forced_tool_choice_constrains_the_output_to_a_call(
    client: TestClient, fake: FakeEngine, tool_choice: Any, names: list[str]
) -> None:
    time_tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    fake.REPLY = json.dumps({"name": names[0], "arguments": {}})
    body = {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, time_tool],
        "tool_choice": tool_choice, "max_tokens": 500,
    }
    reply = client.post("/v1/chat/completions", json=body).json()
    constraint = fake.requests[-1].params.constraint
    assert constraint is not None and constraint.kind == "json_schema"
    schemas = constraint.value.get("anyOf", [constraint.value])
    assert [schema["properties"]["name"]["const"] for schema in schemas] == names
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == names[0]


def test_tool_choice_none_and_bad_choices(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = CALL
    base = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    reply = client.post("/v1/chat/completions", json={**base, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert reply["choices"][0]["message"]["content"] == CALL  # no parsing: the model was told no tools
    assert "get_weather" not in prompt_of(fake)
    for bad, param in (
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ):
        response = client.post("/v1/chat/completions", json={**base, **bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == param


def test_parallel_tool_calls_false_keeps_the_first_call(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = CALL + CALL.replace("Paris", "Rome")
    body = {
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
        "max_tokens": 500, "parallel_tool_calls": False,
    }
    calls = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]


def test_tool_parser_none_in_the_config_turns_parsing_off(fake: FakeEngine) -> None:
    fake.REPLY = CALL
    ctx = make_ctx(fake)
    ctx.config.models[0].tool_parser = "none"
    with TestClient(build_app(ctx)) as client:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 500}
        assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == CALL


def test_an_unknown_parser_name_is_a_config_error_naming_the_key() -> None:
    config = Config(models=[ModelConfig(path="x", tool_parser="hermez", reasoning_parser="thinking")])
    with pytest.raises(ConfigError) as info:
        validate_parser_choices(config, load_plugins().registries)
    text = str(info.value)
    assert "models[0].tool_parser" in text and "did you mean hermes" in text
    assert "models[0].reasoning_parser" in text
    validate_parser_choices(Config(models=[ModelConfig(path="x", tool_parser="mistral")]), load_plugins().registries)


def test_ollama_chat_returns_tool_calls_with_object_arguments_and_thinking(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "<think>hmm</think>" + CALL
    body = {
        "model": "fake", "stream": False, "think": True, "tools": [WEATHER], "options": {"num_predict": 500},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "snow", "tool_name": "get_weather"},
            {"role": "user", "content": "And Paris?"},
        ],
    }
    message = client.post("/api/chat", json=body).json()["message"]
    assert message["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert message["thinking"] == "hmm" and message["content"] == ""
    assert "<tool_response>\nsnow\n</tool_response>" in prompt_of(fake)
    streamed = client.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    messages = [json.loads(line)["message"] for line in streamed]
    assert [c for m in messages for c in m.get("tool_calls", [])] == message["tool_calls"]
    assert "".join(m.get("thinking", "") for m in messages) == "hmm"
    assert not "".join(m["content"] for m in messages)


# -- Anthropic ------------------------------------------------------------------------------------

ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_anthropic_tool_use_and_thinking_blocks(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "<think>The user wants weather.</think>Let me look. " + CALL
    body = {"model": "fake", "max_tokens": 500, "tools": [ANTHROPIC_WEATHER],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    reply = client.post("/v1/messages", json=body).json()
    assert reply["stop_reason"] == "tool_use"
    thinking, text, tool_use = reply["content"]
    assert thinking == {"type": "thinking", "thinking": "The user wants weather.", "signature": ""}
    assert text == {"type": "text", "text": "Let me look. "}
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "get_weather"
    assert tool_use["input"] == {"city": "Paris"} and tool_use["id"]
    assert "<tool_call>" not in json.dumps(reply) and "<think>" not in json.dumps(reply)


def test_anthropic_tool_results_go_back_to_the_model(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = "It is sunny."
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21C"}]},
            {"type": "text", "text": "Thanks"},
        ]},
    ]
    body = {"model": "fake", "max_tokens": 500, "tools": [ANTHROPIC_WEATHER], "messages": messages}
    reply = client.post("/v1/messages", json=body).json()
    assert reply["content"] == [{"type": "text", "text": "It is sunny."}] and reply["stop_reason"] == "end_turn"
    prompt = prompt_of(fake)
    assert '<assistant><tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt and "Thanks" in prompt and "hmm" not in prompt
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"}).json()
    assert counted["input_tokens"] == len(fake.requests[-1].prompt_ids)


def test_anthropic_forced_tool_choice_constrains_and_streams_with_the_client(fake: FakeEngine) -> None:
    import anthropic

    fake.REPLY = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        with client.messages.stream(
            model="fake", max_tokens=500, tools=[ANTHROPIC_WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
        ) as stream:
            final = stream.get_final_message()
        constraint = fake.requests[-1].params.constraint
        assert constraint is not None and constraint.kind == "json_schema"
        (block,) = final.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Oslo"}
        assert final.stop_reason == "tool_use"
        fake.REPLY = "<think>Cold, probably.</think>Bring a coat."
        final = client.messages.create(
            model="fake", max_tokens=500, messages=[{"role": "user", "content": "Oslo?"}],
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "Cold, probably."  # type: ignore[union-attr]
        assert final.content[1].text == "Bring a coat."  # type: ignore[union-attr]


def test_ollama_tool_choice_option_forces_a_call(client: TestClient, fake: FakeEngine) -> None:
    fake.REPLY = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})
    body = {"model": "fake", "stream": False, "messages": [{"role": "user", "content": "Rome?"}], "tools": [WEATHER],
            "options": {"tool_choice": "get_weather", "num_predict": 200}}
    message = client.post("/api/chat", json=body).json()["message"]
    assert message.get("tool_calls") == [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}], message
    constraint = fake.requests[-1].params.constraint
    assert constraint is not None and constraint.value["properties"]["name"]["const"] == "get_weather"
    bad = client.post("/api/chat", json={**body, "options": {"tool_choice": "get_time", "num_predict": 200}})
    assert bad.status_code == 400 and "options.tool_choice" in bad.json()["error"]
    fake.REPLY = "plain"
    client.post("/api/chat", json={**body, "options": {}})
    assert fake.requests[-1].params.constraint is None
