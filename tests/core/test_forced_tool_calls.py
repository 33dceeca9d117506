"""Forced tool calls: the constraint holds a call's arguments to the keys the tool declares."""

from __future__ import annotations

import json

import pytest

from mlxr_core.chat.parsing import Tool, closed_objects
from mlxr_core.chat.tools import call_schema
from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import Constraint, Delta, Finished, GenerationRequest, SamplingParams
from mlxr_plugins.samplers.structured import GrammarMask, structured

#: As clients send it: silent on additionalProperties, like most tools in the wild.
WEATHER = Tool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "when": {"type": "object", "properties": {"day": {"enum": ["today", "tomorrow"]}}},
        },
        "required": ["city"],
    },
)


def test_objects_that_list_properties_are_closed_and_explicit_choices_kept():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "map": {"type": "object", "additionalProperties": {"type": "object", "properties": {}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
            "both": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
        },
        "$defs": {"d": {"properties": {"e": {}}}},
    }
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # free-form: no properties listed
    assert props["open"]["additionalProperties"] is True
    assert props["map"]["additionalProperties"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # allOf parts left open
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the tool's own schema is not changed


def walk(tokenizer, mask: GrammarMask, text: str) -> set[bytes]:
    """Accept ``text`` token by token; the pieces allowed next."""
    import numpy as np

    for token in tokenizer.encode(text, add_special_tokens=False):
        mask.accept(token)
    pieces = tokenizer.token_bytes().pieces
    return {pieces[i] for i in np.nonzero(mask.allowed(len(pieces)))[0]}


def test_no_key_outside_the_schema_can_start(toy_tokenizer):
    constraint = Constraint("json_schema", call_schema([WEATHER]))
    mask = structured(SamplingParams(constraint=constraint), SamplerContext(tokenizer=toy_tokenizer))
    assert isinstance(mask, GrammarMask)
    allowed = walk(toy_tokenizer, mask, '{"name":"get_weather","arguments":{"city":"Paris","')
    # Only the rest of the one other declared key: never '"' (the empty key) or another name.
    assert allowed and all(b'when"'.startswith(piece) for piece in allowed), allowed


@pytest.mark.parametrize("seed", range(4))
def test_a_random_model_forced_to_call_writes_only_declared_keys(tiny_engine, seed):
    params = SamplingParams(
        temperature=1.5, seed=seed, max_tokens=120, constraint=Constraint("json_schema", call_schema([WEATHER]))
    )
    events = list(tiny_engine.submit(GenerationRequest(model="tiny", prompt_ids=[5, 6, 7], params=params)))
    assert isinstance(events[-1], Finished)
    if events[-1].reason != "stop":
        pytest.skip("the random model ran out of tokens before closing the call")
    call = json.loads("".join(e.text for e in events if isinstance(e, Delta)))
    assert set(call["arguments"]) <= {"city", "when"} and "city" in call["arguments"]
    assert set(call["arguments"].get("when", {})) <= {"day"}
