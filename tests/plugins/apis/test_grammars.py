"""Grammars in the fields other servers' clients send (vLLM's ``structured_outputs`` and ``guided_*``,
llama.cpp's ``grammar`` and ``json_schema``), on the real engine with a tiny random model: whatever the
weights say, the output is in the grammar's language; a grammar that cannot be enforced, or two
constraints in one request, is a 400 naming the fields."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from litestar.testing import TestClient

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CODE = r"[0-9]{3}-[a-z]{2}"
#: Bounded, so a random model finishes it well within ``max_tokens``.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["colour", "size", "tags"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", 'a "quoted" one']
#: The same language, ``(yes|no), `` then two to four lowercase letters, in Lark and in GBNF.
LARK = 'start: ANSWER ", " WORD\nANSWER: "yes" | "no"\nWORD: /[a-z]{2,4}/'
GBNF = 'root ::= answer ", " word\nanswer ::= "yes" | "no"\nword ::= [a-z] [a-z] [a-z]? [a-z]?'
ANSWER = r"(yes|no), [a-z]{2,4}"


def body(path: str, seed: int, **fields: Any) -> dict[str, Any]:
    common = {"model": "tiny", "max_tokens": 60, "temperature": 1.0, "seed": seed, **fields}
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "go"}], **common}
    return {"prompt": "go", **common}


def generated(client: TestClient, path: str, seed: int, **fields: Any) -> str:
    r = client.post(path, json=body(path, seed, **fields))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    text: str = choice["message"]["content"] if path == CHAT else choice["text"]
    return text


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("path", "fields"),
    [(CHAT, {"structured_outputs": {"regex": CODE}}), (COMPLETIONS, {"guided_regex": CODE})],
)
def test_a_regex_is_matched_exactly(tiny_app: TestClient, path: str, fields: dict[str, Any], seed: int) -> None:
    text = generated(tiny_app, path, seed, **fields)
    assert re.fullmatch(CODE, text), text


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("path", "fields"),
    [(CHAT, {"structured_outputs": {"choice": CHOICES}}), (COMPLETIONS, {"guided_choice": CHOICES})],
)
def test_a_choice_answers_one_of_the_choices(tiny_app: TestClient, path: str, fields: dict[str, Any], seed: int) -> None:
    assert generated(tiny_app, path, seed, **fields) in CHOICES


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (CHAT, {"structured_outputs": {"grammar": LARK}}),  # vLLM's grammar, in Lark
        (CHAT, {"guided_grammar": GBNF}),  # or GBNF, as vLLM's other backends take it
        (COMPLETIONS, {"grammar": GBNF}),  # llama.cpp's
        (COMPLETIONS, {"grammar": "%llguidance {}\n" + LARK}),  # llama.cpp's way to send Lark
        (CHAT, {"grammar": GBNF}),
    ],
    ids=["lark", "guided-gbnf", "gbnf", "llama.cpp-lark", "chat-gbnf"],
)
def test_a_grammar_keeps_the_output_in_its_language(
    tiny_app: TestClient, path: str, fields: dict[str, Any], seed: int
) -> None:
    text = generated(tiny_app, path, seed, **fields)
    assert re.fullmatch(ANSWER, text), text


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (COMPLETIONS, {"json_schema": SCHEMA}),  # llama.cpp's
        (CHAT, {"json_schema": SCHEMA}),
        (CHAT, {"structured_outputs": {"json": SCHEMA}}),
        (COMPLETIONS, {"guided_json": json.dumps(SCHEMA)}),  # vLLM takes the schema as JSON text too
    ],
    ids=["json_schema", "chat-json_schema", "structured_outputs.json", "guided_json-text"],
)
def test_a_json_schema_validates_the_output(
    tiny_app: TestClient, path: str, fields: dict[str, Any], seed: int
) -> None:
    jsonschema.validate(json.loads(generated(tiny_app, path, seed, **fields)), SCHEMA)


def test_json_object_is_any_json_object(tiny_app: TestClient) -> None:
    r = tiny_app.post(CHAT, json=body(CHAT, 0, max_tokens=4, structured_outputs={"json_object": True}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")


def error_of(client: TestClient, path: str, **fields: Any) -> dict[str, Any]:
    r = client.post(path, json=body(path, 0, **fields))
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"grammar": "root ::= ("}, "grammar", "GBNF"),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),
        ({"grammar": "start: ("}, "grammar", "grammar"),  # Lark, refused by llguidance
        ({"structured_outputs": {"grammar": "start: ANSWER"}}, "structured_outputs.grammar", "ANSWER"),
        ({"guided_grammar": ""}, "guided_grammar", "root"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
        ({"guided_regex": "(?=a)b"}, "guided_regex", "regex"),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "uniqueItems"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON"),
        ({"guided_json": "[" * 200 + "]" * 200}, "guided_json", "deeper"),
        ({"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
        ({"structured_outputs": {}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx", "regx"),
        ({"guided_choice": []}, "guided_choice", "length"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "str"),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_its_field(
    tiny_app: TestClient, path: str, fields: dict[str, Any], param: str, says: str
) -> None:
    error = error_of(tiny_app, path, **fields)
    assert error["param"] == param and says in error["message"], error


def test_it_is_refused_before_the_request_is_queued(tiny_app: TestClient) -> None:
    """Streamed, the refusal is still the reply's status, not an event after a 200."""
    r = tiny_app.post(CHAT, json=body(CHAT, 0, stream=True, grammar="root ::= ("))
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"grammar": GBNF, "json_schema": SCHEMA}, ("grammar", "json_schema")),
        ({"response_format": {"type": "json_object"}, "guided_regex": CODE}, ("response_format", "guided_regex")),
        ({"structured_outputs": {"regex": CODE, "choice": CHOICES}}, ("structured_outputs.regex", "structured_outputs.choice")),
        ({"structured_outputs": {"json_object": True}, "guided_json": SCHEMA}, ("structured_outputs.json_object", "guided_json")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_two_constraints_are_a_400_naming_both(
    tiny_app: TestClient, path: str, fields: dict[str, Any], named: tuple[str, str]
) -> None:
    error = error_of(tiny_app, path, **fields)
    assert all(name in error["message"] for name in named), error
    assert error["param"] in named


def test_ollama_names_its_own_format_field(tiny_app: TestClient) -> None:
    r = tiny_app.post("/api/chat", json={
        "model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": False,
        "format": {"type": "array", "uniqueItems": True},
    })  # fmt: skip
    assert r.status_code == 400 and r.json()["error"].startswith("format: "), r.text


def test_the_grammar_fields_are_in_the_openapi_document(tiny_app: TestClient) -> None:
    paths = tiny_app.get("/schema/openapi.json").json()["paths"]
    for path in (CHAT, COMPLETIONS):
        fields = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert {"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "grammar", "json_schema"} <= set(fields), path  # fmt: skip
        outputs = fields["structured_outputs"]["anyOf"][0]
        assert set(outputs["properties"]) == {"json", "regex", "choice", "grammar", "json_object"}
        assert outputs["additionalProperties"] is False


def defs_chain(n: int) -> dict[str, Any]:
    """Issue 42's schema: ``$defs`` ``d0`` .. ``dn``, each holding the next through a ``$ref``."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                                      "required": ["a"]} for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


#: The issue's 3,000-deep chain (286 KB) and the same 700 deep (under the byte limit, over the depth).
DEEP_SCHEMAS = [defs_chain(3000), defs_chain(700)]
LARK_CHAIN = "\n".join(["start: a0", *(f'a{i}: "(" a{i + 1} ")" | "x"' for i in range(3000)), 'a3000: "x"'])
LARK_SEQUENCE = "\n".join(["start: a0", *(f'a{i}: "x" a{i + 1}' for i in range(3000)), 'a3000: "y"'])
GBNF_CHAIN = "\n".join(["root ::= a0", *(f'a{i} ::= "x" a{i + 1}' for i in range(20_000)), 'a20000 ::= "y"'])


def refusal(r: Any) -> str:
    """The refusal's message, which carries no panic nor backtrace."""
    assert r.status_code == 400, r.text[:300]
    assert "panic" not in r.text and "backtrace" not in r.text and "\\n" not in r.text
    error = r.json()["error"]
    message: str = error if isinstance(error, str) else error["message"]
    return message


@pytest.mark.parametrize("schema", DEEP_SCHEMAS, ids=["3000-deep", "700-deep"])
def test_a_deep_schema_is_a_400_on_every_route_not_a_crash(tiny_app: TestClient, schema: dict[str, Any]) -> None:
    """N1: the server died (SIGSEGV) on these, through each API's own field."""
    says = "engine.constraint_limits.max_"
    chat = body(CHAT, 0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    r = tiny_app.post(CHAT, json=chat)
    assert says in refusal(r) and r.json()["error"]["param"] == "response_format"
    r = tiny_app.post("/api/chat", json={
        "model": "tiny", "messages": [{"role": "user", "content": "JSON"}], "stream": False, "format": schema})  # fmt: skip
    assert says in refusal(r) and r.json()["error"].startswith("format: ")
    r = tiny_app.post("/v1/responses", json={
        "model": "tiny", "input": "JSON", "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})  # fmt: skip
    assert says in refusal(r)
    assert tiny_app.post(CHAT, json=body(CHAT, 0, json_schema={"type": "integer"})).status_code == 200  # alive


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"structured_outputs": {"grammar": LARK_CHAIN}}, "structured_outputs.grammar", "nests 3,002 levels"),
        ({"grammar": LARK_SEQUENCE}, "grammar", "max_depth (256)"),
        ({"grammar": GBNF_CHAIN}, "grammar", "max_bytes (131,072)"),
        # N9: 100,000 choices and a 1 MB grammar of 110,000 alternatives took 8-11 s and told a panic.
        ({"structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}}, "structured_outputs.choice",
         "max_bytes"),
        ({"grammar": "root ::= " + " | ".join(f'"alternative{i}"' for i in range(110_000))}, "grammar", "max_bytes"),
        ({"guided_choice": [str(i) for i in range(12_000)]}, "guided_choice", "max_alternatives (10,000)"),
        ({"guided_regex": "(a{1024}){1024}"}, "guided_regex", "max_repetition (10,000)"),
    ],
)  # fmt: skip
def test_a_huge_or_deep_grammar_is_a_400_naming_the_limit(
    tiny_app: TestClient, fields: dict[str, Any], param: str, says: str
) -> None:
    r = tiny_app.post(COMPLETIONS, json=body(COMPLETIONS, 0, **fields))
    assert says in refusal(r) and r.json()["error"]["param"] == param
