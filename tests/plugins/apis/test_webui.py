"""The web page plugin (``webui``): its files are served with the right types and a strict policy,
it is on by default on loopback only and off when ``apis:`` leaves it out, and with API keys set the
page's files load while everything the page reads or generates needs the key.

The page itself (streaming, stop, the status plots, the markdown renderer) is driven in a real
Chromium by ``tests/test_acceptance_webui.py``."""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, Router, get, post
from litestar.testing import TestClient

from mlxr_core.config.loader import load_config
from mlxr_core.config.schema import Config, ModelConfig, ServerConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.access import PUBLIC
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import hookimpl, load_plugins

KEY = "sk-webui-test-key"
FILES = {"/ui/": "text/html", "/ui/app.js": "text/javascript", "/ui/app.css": "text/css"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    config = Config(models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=128)])
    engine = Engine(config, load_plugins())
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def make_app(engine: Engine, apis: list[str] | None = None, **server: Any) -> Litestar:
    settings: dict[str, Any] = {"models": engine.config.models, "server": ServerConfig(**server)}
    if apis is not None:
        settings["apis"] = apis
    config = Config(**settings, engine=engine.config.engine)
    return build_app(ServerContext(config=config, host=engine.host, engine=engine))


class Assets(HTMLParser):
    """Every URL a page loads by itself (scripts, style sheets, icons, images)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("script", "img") and found.get("src"):
            self.urls.append(str(found["src"]))
        if tag == "link" and found.get("href"):
            self.urls.append(str(found["href"]))


def test_the_page_its_script_and_style_are_served_with_their_types_and_a_strict_policy(engine: Engine) -> None:
    with TestClient(make_app(engine, ["openai", "webui"])) as client:
        for path, media_type in FILES.items():
            r = client.get(path)
            assert r.status_code == 200, (path, r.text)
            assert r.headers["content-type"] == f"{media_type}; charset=utf-8"
            assert r.headers["x-content-type-options"] == "nosniff"
            policy = r.headers["content-security-policy"]
            assert "default-src 'none'" in policy and "script-src 'self'" in policy
            assert "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert client.get("/ui").text == client.get("/ui/").text  # with or without the slash
        root = client.get("/", follow_redirects=False)
        assert root.status_code in (301, 302, 307, 308) and root.headers["location"] == "/ui/"
        assert client.get("/ui/missing.js").status_code == 404


def test_the_page_loads_nothing_from_another_origin(engine: Engine) -> None:
    with TestClient(make_app(engine, ["openai", "webui"])) as client:
        parser = Assets()
        parser.feed(client.get("/ui/").text)
    assert sorted(parser.urls) == ["/ui/app.css", "/ui/app.js", "data:,"]
    for url in parser.urls:
        assert url.startswith(("/ui/", "data:")), url


def test_on_by_default_on_loopback_only_and_off_when_apis_leaves_it_out(engine: Engine) -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        with TestClient(make_app(engine, host=host)) as client:
            assert client.get("/ui/").status_code == 200, host
    # Bound to every interface: not unless apis: asks for it.
    with TestClient(make_app(engine, host="0.0.0.0")) as client:
        assert client.get("/ui/").status_code == 404
        assert client.get("/v1/models").status_code == 200
    with TestClient(make_app(engine, ["openai", "webui"], host="0.0.0.0")) as client:
        assert client.get("/ui/").status_code == 200
    # Turned off by an apis: without it, on loopback too: no page, no redirect at /.
    with TestClient(make_app(engine, ["openai", "ollama"])) as client:
        for path in ("/", "/ui", "/ui/", "/ui/app.js"):
            assert client.get(path, follow_redirects=False).status_code == 404, path


def test_with_api_keys_the_files_load_and_every_request_the_page_makes_needs_the_key(engine: Engine) -> None:
    with TestClient(make_app(engine, api_keys=[KEY], auth_exempt=[])) as client:
        # A browser cannot send a header with the page it navigates to; the files hold no data.
        for path in (*FILES, "/ui"):
            assert client.get(path).status_code == 200, path
        assert client.get("/", follow_redirects=False).headers["location"] == "/ui/"
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                                   ("GET", "/metrics", None)):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
            r = client.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (path, r.text)
        # The exemption belongs to the page's own routes, not to whatever sits under its path.
        assert client.post("/ui/", json={}).status_code in (401, 405)


def test_the_config_default_follows_the_bind_address(tmp_path: Path) -> None:
    assert "webui" in load_config(None, environ={}).apis  # the embedded default binds 127.0.0.1
    for host in ("0.0.0.0", "::", "192.168.1.20", "example.com"):
        assert load_config(None, environ={"MLXR_HOST": host}).apis == ["openai", "ollama", "anthropic", "rerank"], host
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert "webui" in load_config(None, environ={"MLXR_HOST": host}).apis, host
    listed = tmp_path / "server.yaml"
    listed.write_text("models: [{path: unused.gguf}]\nserver: {host: 0.0.0.0}\napis: [openai, webui]\n")
    assert load_config(listed, environ={}).apis == ["openai", "webui"]


def test_the_page_warns_when_the_openai_api_it_chats_through_is_not_mounted(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="mlxr_plugins.apis.webui.routes"):
        make_app(engine, ["ollama", "webui"])
    assert "openai" in caplog.text


class PublicToy:
    """An API plugin marking a GET and a POST route public."""

    @hookimpl
    def mlxr_register_apis(self, register: Any) -> None:
        @get("/toy/file", sync_to_thread=False, opt={PUBLIC: True})
        def file() -> str:
            return "same for everyone"

        @post("/toy/act", sync_to_thread=False, opt={PUBLIC: True})
        def act() -> str:
            return "acted"

        register("toy", lambda ctx: Router(path="/", route_handlers=[file, act]))


def test_only_get_routes_can_be_public(engine: Engine) -> None:
    config = Config(models=engine.config.models, apis=["toy"], server=ServerConfig(api_keys=[KEY]))
    host = load_plugins(extra=[("toy", PublicToy())])
    with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as client:
        assert client.get("/toy/file").text == "same for everyone"
        assert client.post("/toy/act", json={}).status_code == 401
        assert client.post("/toy/act", json={}, headers={"authorization": f"Bearer {KEY}"}).text == "acted"
