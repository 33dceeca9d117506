"""Hostile requests through the live app, for each API: each one a 4xx in that API's own error shape
without a traceback, and the server still healthy afterwards. Also hostile chat templates: a model
whose template reaches for Python internals fails the request, not the server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from mlxr_core.config.schema import Config, ModelConfig, ServerConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.model import chat_template
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf

MAX_BODY = 1_000_000
CAP = 4
#: Templates that try to reach Python internals or exhaust memory.
EVIL_TEMPLATES = {
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "context": "{{ self._TemplateReference__context.cycler.__init__.__globals__ }}",
    "range": "{{ range(10**10) | list }}",
    "repeat": "{{ 'x' * 10**10 }}",
    "power": "{{ 2 ** 100000 }}",
    "nested_power": "{{ (10 ** 4000) ** 4000 }}",
    # Bounded by the render deadline (shortened to RENDER_SECONDS here), not by any one operation.
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling_macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    # Work inside filters and globals (issue 42, N2): a request took 140 s to be refused.
    "filter_chain": "{{ ((range(100000)|list)*160)" + "|map('string')|map('length')" * 3 + "|sum }}",
    "filter_chain_in_limits": "{{ ((range(100000)|list)*10)" + "|map('string')|map('length')" * 12 + "|sum }}",
    "center": "{{ 'x'|center(1000000000) }}",
    "lipsum": "{{ lipsum(n=2000000) }}",
}
RENDER_SECONDS = 0.5

# Each API: its generating route, a valid body, where the messages and the stop strings go, and
# whether a body is in its error shape.
APIS: dict[str, dict[str, Any]] = {
    "openai": {
        "path": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        "stop": ("stop",),
        "max_tokens": ("max_tokens",),
        "shape": lambda b: isinstance(b["error"]["message"], str) and "type" in b["error"],
        "tokens": lambda b: b["usage"]["completion_tokens"],
    },
    "ollama": {
        "path": "/api/chat",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False},
        "stop": ("options", "stop"),
        "max_tokens": ("options", "num_predict"),
        "shape": lambda b: set(b) == {"error"} and isinstance(b["error"], str),
        "tokens": lambda b: b["eval_count"],
    },
    "anthropic": {
        "path": "/v1/messages",
        "body": {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        "stop": ("stop_sequences",),
        "max_tokens": ("max_tokens",),
        "shape": lambda b: b["type"] == "error" and isinstance(b["error"]["message"], str),
        "tokens": lambda b: b["usage"]["output_tokens"],
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("hostile")
    models = [ModelConfig(path=str(write_tiny_llama_gguf(folder / "tiny.gguf")), name="tiny", context_length=128)]
    for name, template in EVIL_TEMPLATES.items():
        path = write_tiny_llama_gguf(folder / f"{name}.gguf", chat_template=template)
        models.append(ModelConfig(path=str(path), name=f"evil-{name}", context_length=128))
    config = Config(
        models=models,
        apis=list(APIS),
        server=ServerConfig(max_body_bytes=MAX_BODY, max_tokens_cap=CAP, access_log=False),
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with (
            pytest.MonkeyPatch.context() as patch,
            TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as test_client,
        ):
            patch.setattr(chat_template, "MAX_RENDER_SECONDS", RENDER_SECONDS)
            yield test_client
    finally:
        engine.stop()


def with_value(body: dict[str, Any], where: tuple[str, ...], value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    node = body
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    return body


def hostile_bodies(api: dict[str, Any]) -> dict[str, bytes]:
    body = api["body"]
    encode: Callable[[Any], bytes] = lambda value: json.dumps(value).encode()  # noqa: E731
    depth = 100_000
    return {
        "oversized": encode({**body, "padding": "x" * (MAX_BODY + 1)}),
        "deeply_nested": b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}",
        # Inside an object the decoder recurses instead of failing on the type first.
        "nested_975_in_an_object": encode(body)[:-1] + b', "extra": ' + b"[" * 975 + b"]" * 975 + b"}",
        "nested_objects": encode(body)[:-1] + b', "extra": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}",
        "negative_max_tokens": encode(with_value(body, api["max_tokens"], -5)),
        "invalid_utf8": encode(body).replace(b'"hi"', b'"h\xff\xfei"'),
        "long_stop_string": encode(with_value(body, api["stop"], ["s" * 100_000])),
        "messages_wrong_type": encode({**body, "messages": "hi"}),
        # Ollama answers an empty chat by loading the model, as Ollama itself does.
        **({"messages_empty": encode({**body, "messages": []})} if "stream" not in body else {}),
        "model_wrong_type": encode({**body, "model": {"name": "tiny"}}),
        "not_an_object": b"[1, 2, 3]",
        "not_json": b"{model: tiny",
        "empty": b"",
    }


CASES = [(name, case) for name, api in APIS.items() for case in hostile_bodies(api)]


@pytest.mark.parametrize(("api_name", "case"), CASES)
def test_hostile_bodies_are_4xx_in_the_apis_shape(client: TestClient, api_name: str, case: str) -> None:
    api = APIS[api_name]
    response = client.post(
        api["path"], content=hostile_bodies(api)[case], headers={"content-type": "application/json"}
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if case == "oversized":
        assert response.status_code == 413
    assert api["shape"](response.json()), response.text[:300]
    assert "Traceback" not in response.text and ".py" not in response.text
    assert client.get("/health").status_code == 200


def post_routes(client: TestClient) -> dict[str, dict[str, Any]]:
    """Every POST route of the app -> the API whose error shape it answers in."""
    paths = sorted({route.path for route in client.app.routes if "POST" in getattr(route, "methods", ())})
    api = lambda path: "anthropic" if path.startswith("/v1/messages") else "ollama" if path.startswith("/api/") else "openai"  # noqa: E731
    return {path: APIS[api(path)] for path in paths}


def test_bodies_nested_deep_inside_an_object_are_4xx_on_every_post_route(client: TestClient) -> None:
    routes = post_routes(client)
    assert len(routes) >= 10, routes
    for depth in (975, 5000):
        body = b'{"model": "tiny", "input": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        for path, api in routes.items():
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, response.status_code, response.text[:300])
            assert api["shape"](response.json()), (path, response.text[:300])
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_a_body_not_declared_as_json_is_a_415_on_every_post_route(client: TestClient, content_type: str | None) -> None:
    """A web page can POST text/plain or a form across sites without a CORS preflight, never JSON:
    from a browser (its ``Origin`` or ``Sec-Fetch-*`` headers), such a body is refused."""
    for path, api in post_routes(client).items():
        body = json.dumps(api["body"]).encode()
        headers = {"content-type": content_type} if content_type else {}
        for browser in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}):
            response = client.post(path, content=body, headers={**headers, **browser})
            assert response.status_code == 415, (path, response.status_code, response.text[:300])
            assert api["shape"](response.json()) and "JSON" in response.text, (path, response.text[:300])


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_from_curl_is_read_whatever_it_declares(client: TestClient, content_type: str | None) -> None:
    """``curl URL -d '{...}'`` (Ollama's own examples) declares a form; no browser sent it, so
    the body is read as the JSON it is, and a body that is not JSON is a 400 in the API's shape."""
    headers = {"content-type": content_type} if content_type else {}
    for name, api in APIS.items():
        response = client.post(api["path"], content=json.dumps(api["body"]).encode(), headers=headers)
        assert response.status_code == 200, (name, response.status_code, response.text[:300])
        response = client.post(api["path"], content=b"model=tiny&prompt=hi", headers=headers)
        assert response.status_code == 400 and api["shape"](response.json()), (name, response.text[:300])
    # JSON with parameters, and the +json types, are JSON.
    api = APIS["openai"]
    for declared in ("application/json; charset=utf-8", "Application/JSON"):
        response = client.post(api["path"], content=json.dumps(api["body"]).encode(), headers={"content-type": declared})
        assert response.status_code == 200, (declared, response.text[:300])


@pytest.mark.parametrize("api_name", list(APIS))
def test_a_prompt_the_context_cannot_hold_is_refused_before_tokenizing(client: TestClient, api_name: str) -> None:
    """Half a megabyte of text for a 128-token context: refused by its length alone (the message
    counts characters, not tokens), however the tokenizer would have fared with it."""
    api = APIS[api_name]
    body = {**api["body"], "messages": [{"role": "user", "content": "ab " * 160_000}]}
    response = client.post(api["path"], json=body)
    assert response.status_code == 400, response.text[:300]
    assert api["shape"](response.json()) and "characters" in response.text, response.text[:300]
    completion = client.post("/v1/completions", json={"model": "tiny", "prompt": "ab " * 160_000})
    assert completion.status_code == 400 and "characters" in completion.text, completion.text[:300]


@pytest.mark.parametrize("max_tokens", [10**9, 10**30])
@pytest.mark.parametrize("api_name", list(APIS))
def test_huge_max_tokens_is_lowered_to_the_cap(client: TestClient, api_name: str, max_tokens: int) -> None:
    api = APIS[api_name]
    body = with_value(api["body"], api["max_tokens"], max_tokens)
    body = with_value(body, ("ignore_eos",), True) if api_name == "openai" else body
    response = client.post(api["path"], json=body)
    assert response.status_code == 200, response.text
    assert 1 <= api["tokens"](response.json()) <= CAP


@pytest.mark.parametrize("api_name", list(APIS))
@pytest.mark.parametrize("template", list(EVIL_TEMPLATES))
def test_hostile_chat_templates_fail_the_request_not_the_server(
    client: TestClient, api_name: str, template: str
) -> None:
    api = APIS[api_name]
    started = time.monotonic()
    response = client.post(api["path"], json={**api["body"], "model": f"evil-{template}"})
    assert time.monotonic() - started < RENDER_SECONDS + 5  # refused within the render deadline
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert api["shape"](response.json())
    assert "Traceback" not in response.text and "uid=" not in response.text
    assert client.get("/health").status_code == 200
    # The same server still serves a model with a sound template.
    assert client.post(api["path"], json=api["body"]).status_code == 200


#: Which API a path falls under, by the shape its error body has (OpenAI's and Anthropic's both
#: hold ``error.message`` and ``error.type``: only OpenAI's has ``param``, only Anthropic's ``type``).
SHAPES: dict[str, Callable[[Any], bool]] = {
    "openai": lambda b: set(b) == {"error"} and set(b["error"]) == {"message", "type", "param", "code"},
    "ollama": lambda b: set(b) == {"error"} and isinstance(b["error"], str),
    "anthropic": lambda b: b["type"] == "error" and set(b["error"]) == {"type", "message"},
}


@pytest.mark.parametrize(
    ("api_name", "method", "path"),
    [
        ("openai", "POST", "/v1/nope"),
        ("openai", "GET", "/v1/chat/completions/nope"),
        ("openai", "GET", "/v1"),
        ("ollama", "GET", "/api/nope"),
        ("ollama", "POST", "/api/chat/nope"),
        ("ollama", "GET", "/api"),
        ("anthropic", "POST", "/v1/messages/nope"),
        ("anthropic", "GET", "/v1/messages/count_tokens/nope"),
    ],
)
def test_an_unknown_path_under_an_apis_prefix_is_a_404_in_that_apis_shape(
    client: TestClient, api_name: str, method: str, path: str
) -> None:
    response = client.request(method, path, json={"model": "tiny"})
    assert response.status_code == 404, response.text[:300]
    assert SHAPES[api_name](response.json()) and path in response.text, response.text[:300]


@pytest.mark.parametrize(
    ("api_name", "method", "path"),
    [("openai", "GET", "/v1/chat/completions"), ("ollama", "GET", "/api/chat"), ("anthropic", "GET", "/v1/messages")],
)
def test_a_method_a_path_does_not_answer_is_a_405_in_that_apis_shape(
    client: TestClient, api_name: str, method: str, path: str
) -> None:
    response = client.request(method, path)
    assert response.status_code == 405 and "POST" in response.headers["allow"], response.text[:300]
    assert SHAPES[api_name](response.json()) and "POST" in response.text, response.text[:300]


def test_a_path_under_no_api_is_a_plain_404(client: TestClient) -> None:
    response = client.get("/nope")
    assert response.status_code == 404 and response.json() == {"error": "no route GET /nope"}
