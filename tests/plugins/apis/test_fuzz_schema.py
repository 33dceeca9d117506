"""Property-based fuzzing of every route the app's OpenAPI document lists, with schemathesis, and the
document checked against the server.

The app mounts every built-in API over the real engine serving a tiny random GGUF model, with
``server.max_tokens_cap`` keeping each generation to a few tokens. Schemathesis generates bodies
both valid and invalid for each route's schema and checks every reply: never a 5xx, never a hang
(each call has a read timeout), a status, content type and body that the document allows,
invalid bodies refused with a 4xx, and valid ones served: a 400 for a body the document allows only
for a rule no JSON schema can state (:data:`mlxr_core.testing.schema_fuzz.UNSTATABLE`). The
document is the structs that decode the bodies (msgspec's own schema of each, with the rules
between fields the routes check by hand), so the bodies it allows and the ones the server serves
agree. Every path answers ``OPTIONS`` with the methods the document lists. ``bench/schema_fuzz.py``
runs schemathesis's own command over a live server, every phase, 1,000 cases per operation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from jsonschema import Draft202012Validator
from litestar import Litestar
from litestar.handlers import HTTPRouteHandler
from litestar.testing import TestClient

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from mlxr_core.config.schema import Config, ModelConfig, ResponsesStoreConfig, ServerConfig  # noqa: E402
from mlxr_core.engine.engine import Engine  # noqa: E402
from mlxr_core.http.context import ServerContext  # noqa: E402
from mlxr_core.http.openapi import json_schema  # noqa: E402
from mlxr_core.http.server import build_app  # noqa: E402
from mlxr_core.plugins import load_plugins  # noqa: E402
from mlxr_core.testing.schema_fuzz import UNSTATABLE, refusal  # noqa: E402

#: Generated cases per route and generation mode; the whole module stays within CI time.
MAX_EXAMPLES = 8
#: Seconds any single call may take before it counts as a hang.
READ_TIMEOUT_S = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def app(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Litestar]:
    store = ResponsesStoreConfig(path=str(tmp_path_factory.mktemp("store") / "responses.sqlite3"))
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=128)],
        apis=["openai", "ollama", "anthropic", "rerank"],
        server=ServerConfig(max_tokens_cap=4, access_log=False, responses_store=store),
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        yield build_app(ServerContext(config=config, host=host, engine=engine))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def fuzzed_app(app: Litestar) -> Any:
    return without_lifespan(app)


@pytest.fixture(scope="module")
def client(app: Litestar) -> TestClient:
    """Requests to the app; its lifespan is not run (the engine is the fixture's)."""
    return TestClient(app)


@pytest.fixture(scope="module")
def document(client: TestClient) -> dict[str, Any]:
    """The OpenAPI document the server publishes."""
    response = client.get("/schema/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def without_lifespan(app: Any) -> Any:
    """``app`` with its lifespan answered but not run: schemathesis starts and stops an app's
    lifespan around loading the schema, and the app's shutdown drains the server for good."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            await send({"type": f"{message['type']}.complete"})
            if message["type"] == "lifespan.shutdown":
                return

    return asgi


@pytest.fixture(scope="module")
def api_schema(fuzzed_app: Any) -> Any:
    loaded = schemathesis.openapi.from_asgi("/schema/openapi.json", fuzzed_app)
    loaded.hook(map_body)
    return loaded


def map_body(context: Any, body: Any) -> Any:
    """Send half of the generated requests to the served model, so that they reach generation (an
    empty name, which the schema refuses, stays as it is)."""
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model and len(model) % 2 == 0:
        return {**body, "model": "tiny"}
    return body


def fuzz(operation: Any, mode: GenerationMode) -> None:
    """Run ``MAX_EXAMPLES`` generated cases of ``mode`` against ``operation``: valid ones are
    served unless a rule no schema can state refuses them (``UNSTATABLE``)."""

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        response = case.call(timeout=READ_TIMEOUT_S)
        # 501 is a route's deliberate "not implemented by this server" (Ollama's embeddings), in the
        # API's error shape; every other 5xx is a failure.
        checks = CHECKS if response.status_code != 501 else CHECKS[1:]
        case.validate_response(response, checks=checks)
        if mode == GenerationMode.POSITIVE and response.status_code == 400:
            message = refusal(response.content)
            assert UNSTATABLE.search(message), f"a body the document allows was refused: {message}\n{case.body!r}"[:2000]

    try:
        check()
    except Unsatisfiable:
        if mode == GenerationMode.POSITIVE:
            raise  # a route without inputs has no invalid requests, but it always has valid ones


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_every_route_survives_fuzzing(api_schema: Any, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 20  # every API's routes are in the document
    failures = []
    for operation in operations:
        try:
            fuzz(operation, mode)
        except Exception as exc:  # collect every route's failure, not just the first
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def typed_routes(app: Litestar) -> Iterator[tuple[str, str, HTTPRouteHandler]]:
    """(method, path, handler) of every route whose handler takes a typed body."""
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if isinstance(handler, HTTPRouteHandler) and handler.parsed_data_field is not None:
                for method in handler.http_methods:
                    yield method.lower(), route.path, handler


def test_the_document_states_the_structs_that_decode_each_body(app: Litestar, document: dict[str, Any]) -> None:
    """A typed route's body and plain JSON reply are documented as msgspec's schema of the very types
    its handler declares: what the document allows is what the decoder accepts."""
    routes = list(typed_routes(app))
    assert len(routes) >= 10, routes
    for method, path, handler in routes:
        operation = document["paths"][path][method]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == json_schema(handler.parsed_data_field.raw), path  # type: ignore[union-attr]
        returned = handler.parsed_fn_signature.return_type.annotation
        if isinstance(returned, type) and issubclass(returned, msgspec.Struct):
            assert operation["responses"]["200"]["content"]["application/json"]["schema"] == json_schema(returned), path


# Bodies on each side of the document's line, for the routes the published schema got wrong: each
# is valid or not by the document, and the server serves (200) or refuses (400) it accordingly.
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
AGREEMENT = [
    ("/v1/chat/completions", {"messages": [], "model": ""}, False),
    ("/v1/chat/completions", {**CHAT, "messages": []}, False),
    ("/v1/chat/completions", {**CHAT, "model": ""}, False),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, False),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, False),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, False),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "developer", "content": "be brief"}, *CHAT["messages"]]}, True),
    ("/v1/chat/completions", CHAT, True),
    ("/v1/completions", {"model": "", "prompt": "hi"}, False),
    ("/v1/embeddings", {"model": "", "input": "hi"}, False),
    ("/v1/embeddings", {"model": "tiny", "input": "hi"}, True),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "messages": []}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 0}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2}, True),
    ("/v1/messages/count_tokens", {"model": "", "messages": CHAT["messages"]}, False),
    ("/api/show", {}, False),
    ("/api/show", {"model": ""}, False),
    ("/api/show", {"model": None}, False),
    ("/api/show", {"model": 5}, False),
    ("/api/show", {"verbose": True}, False),
    ("/api/show", {"model": "tiny"}, True),
    ("/api/show", {"name": "tiny"}, True),
    ("/api/show", {"model": "tiny", "verbose": True, "extra": 1}, True),
    ("/api/chat", {"messages": []}, False),
    ("/api/chat", {"model": "", "messages": []}, False),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}], "stream": False}, False),
    ("/api/chat", {"model": "tiny", "messages": []}, True),  # Ollama's way to load a model
    ("/api/chat", {**CHAT, "stream": False}, True),
    ("/api/generate", {"prompt": "hi", "stream": False}, False),
    ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}, True),
    ("/api/embed", {"model": "", "input": "hi"}, False),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": ["a", "b"]}}, True),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": []}}, False),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regx": "a"}}, False),
    ("/v1/chat/completions", {**CHAT, "guided_regex": 5}, False),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "grammar": 'root ::= "a" | "b"'}, True),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "json_schema": {"type": "string"}}, True),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "json_schema": "x"}, False),
    # The mismatches schemathesis found (hostile input, round three): each now stated or served.
    ("/api/chat", {**CHAT, "stream": False, "keep_alive": ""}, False),
    ("/api/chat", {**CHAT, "stream": False, "keep_alive": "5m"}, True),
    ("/api/chat", {**CHAT, "stream": False, "keep_alive": 30}, True),
    ("/api/chat", {**CHAT, "stream": False, "think": ""}, False),
    ("/api/chat", {**CHAT, "stream": False, "think": True}, True),  # a model that does not think ignores it
    ("/api/chat", {**CHAT, "stream": False, "options": {"num_predict": 2.0}}, True),  # JSON Schema's integer
    ("/api/chat", {**CHAT, "stream": False, "options": {"num_predict": 2.5}}, False),
    ("/api/chat", {**CHAT, "stream": False, "options": {"tool_choice": "required"}}, False),
    ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "think": True}, False),
    ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "suffix": "x"}, False),
    ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "suffix": ""}, True),
    ("/api/embed", {"model": "tiny", "input": "hi", "dimensions": 0}, True),
    ("/api/embed", {"model": "tiny", "input": "hi", "dimensions": 8}, False),
    ("/api/embed", {"model": "tiny", "input": ["hi", ""]}, False),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, False),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2, "logprobs": True}, True),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.0}, True),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, False),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, False),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, False),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 0}, False),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 1}, True),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True}, False),
    ("/v1/completions", {"model": "tiny", "prompt": [1.0, 2.0]}, True),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, False),
    ("/v1/embeddings", {"model": "tiny", "input": ""}, False),
    ("/v1/embeddings", {"model": "tiny", "input": [5.0, 6]}, True),
    ("/v1/embeddings", {"model": "tiny", "input": "hi", "dimensions": 8}, False),
    ("/detokenize", {"model": "tiny", "tokens": [10**9]}, True),  # outside the vocabulary: nothing
    ("/detokenize", {"model": "tiny", "tokens": [-1]}, False),
    ("/tokenize", {"model": "tiny"}, False),
    ("/tokenize", {"model": "tiny", "prompt": "hi"}, True),
    ("/v1/rerank", {"model": "tiny", "query": "q", "documents": []}, False),
    ("/v1/score", {"model": "tiny", "text_1": "a", "text_2": []}, False),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "message", "role": None}]}, False),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "message", "role": "user", "content": "hi"}]}, True),
    ("/v1/responses", {"model": "tiny", "input": [{"type": "function_call", "name": "f"}]}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "stop_sequences": [""]}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "thinking": {"type": "sometimes"}}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "thinking": {"type": "enabled"}}, True),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "tool_choice": {"type": "any"}}, False),
    ("/v1/messages", {**CHAT, "max_tokens": 2, "top_k": 1, "temperature": 1.0}, True),  # was a 500
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]}, False),
    ("/v1/messages/count_tokens", {"model": "tiny", "system": "s", "messages": [{"role": "assistant", "content": "x"}]}, True),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, False),
]


@pytest.mark.parametrize(("path", "body", "valid"), AGREEMENT)
def test_the_document_and_the_server_agree_on_a_body(
    client: TestClient, document: dict[str, Any], path: str, body: dict[str, Any], valid: bool
) -> None:
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    errors = [error.message for error in Draft202012Validator(schema).iter_errors(body)]
    assert (not errors) == valid, errors
    response = client.post(path, json=body)
    assert response.status_code == (200 if valid else 400), response.text[:300]


def test_options_lists_every_method_the_document_lists(client: TestClient, document: dict[str, Any]) -> None:
    """``Allow`` of an ``OPTIONS`` answer: exactly the methods the document lists for the path
    (and OPTIONS), also where two routers serve one path (``/v1/models/{id}``: GET and POST)."""
    for path, operations in document["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "tiny", path)
        response = client.options(concrete)
        assert response.status_code == 204, (path, response.status_code)
        allowed = {method.strip() for method in response.headers["allow"].split(",")} - {"OPTIONS", "HEAD"}
        # HEAD: Litestar's own for every GET, and a route of its own for Ollama's blobs.
        assert allowed == {method.upper() for method in operations} - {"HEAD"}, path


@pytest.mark.parametrize(
    ("mode", "check"),
    [(GenerationMode.POSITIVE, positive_data_acceptance), (GenerationMode.NEGATIVE, negative_data_rejection)],
    ids=["valid-served", "invalid-refused"],
)
def test_show_serves_exactly_the_bodies_its_schema_allows(api_schema: Any, mode: GenerationMode, check: Any) -> None:
    """``/api/show``, whose answer depends on nothing but the model it names: every generated valid
    body is served (or a 404 for a model not served), every invalid one refused."""

    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(case=api_schema["/api/show"]["POST"].as_strategy(generation_mode=mode))
    def served(case: Any) -> None:
        case.validate_response(case.call(timeout=READ_TIMEOUT_S), checks=[check])

    served()


def test_streamed_replies_are_documented_with_their_events(document: dict[str, Any]) -> None:
    """A route that may stream documents both replies: the JSON one, and the stream's media type
    with the schema of each event (not a bare string)."""
    streamed = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            content = operation["responses"].get("200", {}).get("content", {})
            for media_type, described in content.items():
                if media_type != "application/json":
                    streamed[(method, path)] = (media_type, described)
    expected = {
        ("post", "/v1/chat/completions"): ("text/event-stream", "ChatCompletionChunk"),
        ("post", "/v1/completions"): ("text/event-stream", "Completion"),
        ("post", "/v1/messages"): ("text/event-stream", "ContentBlockDelta"),
        ("post", "/api/chat"): ("application/x-ndjson", "ChatChunk"),
        ("post", "/api/generate"): ("application/x-ndjson", "GenerateChunk"),
    }
    for route, (media_type, event) in expected.items():
        documented_type, described = streamed[route]
        assert documented_type == media_type, route
        assert described["schema"]["contentMediaType"] == media_type and "x-item-schema" in described["schema"]["description"]
        assert event in msgspec.json.encode(described["x-item-schema"]).decode(), route
        assert "error" in msgspec.json.encode(described["x-item-schema"]).decode(), route  # a failure mid-stream


#: Pieces of grammars, regexes and schemas, spliced at random with a little arbitrary text between.
GRAMMAR_PIECES = ['root ::= ', 'start: ', '%llguidance {}\n', '"a"', '"', "'", "[a-z]", "[", "]", "(", ")", "|",
                  "*", "+", "?", "{2,3}", "{", "}", "\\", "\n", "/", "x ::= root", "::=", ":", "%ignore", "."]  # fmt: skip
grammar_text = st.lists(st.sampled_from(GRAMMAR_PIECES) | st.text(max_size=3), max_size=12).map("".join)
grammar_fields = st.one_of(
    st.fixed_dictionaries({"grammar": grammar_text}),
    st.fixed_dictionaries({"guided_grammar": grammar_text}),
    st.fixed_dictionaries({"guided_regex": grammar_text}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({"grammar": grammar_text})}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({"regex": grammar_text})}),
    st.fixed_dictionaries({"structured_outputs": st.fixed_dictionaries({"choice": st.lists(st.text(), min_size=1, max_size=4)})}),
    st.fixed_dictionaries({"guided_json": grammar_text}),
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(fields=grammar_fields)
def test_grammar_fields_of_any_text_are_served_or_refused_naming_the_field(client: TestClient, fields: dict[str, Any]) -> None:
    """Grammars, regexes and schemas of hostile text: a 200, or a 400 naming the field; never a 5xx."""
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **fields})
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        (name,) = fields
        param = response.json()["error"]["param"]
        assert param == name or param.startswith(f"{name}."), (param, fields)
