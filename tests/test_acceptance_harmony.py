"""Acceptance: gpt-oss's Harmony format on a live ``mlxr serve``, through the official ``openai``,
``anthropic`` and ``ollama`` clients. The model is a tiny random llama whose vocabulary has
Harmony's special tokens and whose chat template renders Harmony, so ``auto`` picks the
``harmony`` parsers; a forced tool choice makes it reason in ``analysis``, then call the tool in
``commentary to=functions.get_weather <|constrain|>json`` (the grammar the structured-output
sampler enforces). Each API must return the reasoning apart (``reasoning_content``, a
``thinking`` block, ``message.thinking``), the call as its tool call, whole and streamed, and no
markup in any text; the tool's result sent back renders as Harmony and the reply has no markup."""

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
from test_acceptance_openai import ServerProcess, serving

from mlxr_core.testing.tiny import HARMONY_SPECIAL_TOKENS, write_tiny_llama_gguf
from mlxr_plugins.parsers.harmony import MARKUP
from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

pytestmark = pytest.mark.slow

MODEL = "tiny-harmony"
PARAMETERS = {
    "type": "object",
    # Enums: the ollama client sends a property's type, description and enum only.
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS}}]
QUESTION = "What is the weather in Paris right now?"
RESULT = json.dumps({"temperature": 21, "sky": "sunny"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = Path(tmp_path_factory.mktemp("harmony"))
    model = write_tiny_llama_gguf(
        folder / "tiny-harmony.gguf", special_tokens=HARMONY_SPECIAL_TOKENS, eos_token="<|return|>",
        chat_template=HARMONY_CHAT_TEMPLATE,
    )
    config = folder / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n    name: {MODEL}\n    context_length: 2048\napis: [openai, anthropic, ollama]\n")
    with serving(config) as process:
        yield process


def no_markup(*texts: str | None) -> None:
    for text in texts:
        assert not any(token in (text or "") for token in MARKUP), text


def test_openai_reasoning_and_tool_call_round_trip(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    ask = {"model": MODEL, "tools": OPENAI_TOOLS, "tool_choice": forced, "max_tokens": 400, "temperature": 0}
    reply = client.chat.completions.create(messages=messages, **ask)
    choice = reply.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.finish_reason == "tool_calls" and not choice.message.content and reasoning
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, PARAMETERS)
    no_markup(reasoning)

    deltas = [c.choices[0].delta for c in client.chat.completions.create(messages=messages, stream=True, **ask) if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == arguments  # type: ignore[union-attr]
    assert "".join(d.content or "" for d in deltas) == ""
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=60, temperature=0)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
    no_markup(message.content, (message.model_extra or {}).get("reasoning_content"))


def test_anthropic_thinking_and_tool_use_round_trip(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=120)
    tools: Any = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": PARAMETERS}]
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    ask: Any = {"model": MODEL, "max_tokens": 400, "extra_body": {"temperature": 0}, "tools": tools,
                "tool_choice": {"type": "tool", "name": "get_weather"}}
    reply = client.messages.create(messages=messages, **ask)
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    thinking, block = reply.content
    assert thinking.thinking  # type: ignore[union-attr]
    no_markup(thinking.thinking)  # type: ignore[union-attr]
    assert block.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(block.input, PARAMETERS)  # type: ignore[union-attr]

    with client.messages.stream(messages=messages, **ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == thinking.thinking  # type: ignore[union-attr]
    assert final.content[1].input == block.input  # type: ignore[union-attr]

    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]},  # type: ignore[union-attr]
    ]
    answer = client.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=tools, messages=messages)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type in ("thinking", "text") for b in answer.content)
    no_markup(*(getattr(b, "text", None) or getattr(b, "thinking", None) for b in answer.content))


def test_ollama_thinking_and_tool_calls_round_trip(server: ServerProcess) -> None:
    client = ollama.Client(host=server.url(), timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    options: Any = {"temperature": 0, "num_predict": 400, "tool_choice": "get_weather"}
    reply = client.chat(model=MODEL, messages=messages, tools=OPENAI_TOOLS, options=options, think=True)
    (call,) = reply.message.tool_calls or []
    assert call.function.name == "get_weather" and not reply.message.content
    assert reply.message.thinking
    no_markup(reply.message.thinking)
    parts = list(client.chat(model=MODEL, messages=messages, tools=OPENAI_TOOLS, options=options, think=True, stream=True))
    assert "".join(part.message.thinking or "" for part in parts) == reply.message.thinking
    assert "".join(part.message.content for part in parts) == ""
    streamed = [c for part in parts for c in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", dict(call.function.arguments))]

    # Without think, the reasoning (which a Harmony model cannot skip) is left out, not shown as content.
    quiet = client.chat(model=MODEL, messages=messages, tools=OPENAI_TOOLS, options=options)
    assert not quiet.message.thinking and not quiet.message.content and quiet.message.tool_calls

    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
    ]
    answer = client.chat(model=MODEL, messages=messages, tools=OPENAI_TOOLS, options={"temperature": 0, "num_predict": 60}, think=True)
    assert not answer.message.tool_calls
    no_markup(answer.message.content, answer.message.thinking)
