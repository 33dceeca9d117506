"""The conformance check of an HTTP API plugin (see :func:`check_api`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxr_core.plugins import PluginHost

#: The key :func:`check_api` configures; requests without it must get 401.
API_KEY = "mlxr-conformance-key"
#: Litestar's own error body: an API answering errors in it has not mounted its own handlers.
LITESTAR_ERROR_KEYS = {"status_code", "detail"}
MODEL_NAME = "tiny"


def check_api(
    name: str,
    model_path: str | Path,
    *,
    host: PluginHost | None = None,
    plugin_config: dict[str, Any] | None = None,
) -> list[str]:
    """Raise AssertionError naming the first broken property of API plugin ``name``.

    Mounts the API alone (``apis: [name]``, one API key configured) over a real engine serving
    ``model_path`` as ``tiny`` (a tiny model: ``mlxr_core.testing.tiny.write_tiny_llama_gguf``),
    then checks: the factory returns a router with at least one route; every route answers 401
    without the key (but a :data:`~mlxr_core.http.access.PUBLIC` one: a GET that answers without it,
    for files that hold no data such as a web page's own), in the API's own JSON error shape (the
    same shape on every route, not Litestar's default body); with the key, every GET route answers
    without a server error (path parameters get the model's name) and every POST route answers a
    malformed JSON body with a 4xx (or 501, not implemented) in that same shape. Returns the
    ``"METHOD path"`` of the routes checked.
    """
    from litestar.testing import TestClient

    from mlxr_core.config.loader import validate_plugin_sections
    from mlxr_core.config.schema import Config, ModelConfig, ServerConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.http.access import PUBLIC
    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.server import build_app
    from mlxr_core.plugins import load_plugins

    host = host if host is not None else load_plugins()
    assert name in host.registries.apis, (
        f"API {name!r} is not registered (registered: {', '.join(host.registries.apis.names())})"
    )
    config = Config(
        models=[ModelConfig(path=str(model_path), name=MODEL_NAME, context_length=128)],
        apis=[name],
        server=ServerConfig(api_keys=[API_KEY]),
    )
    sections = validate_plugin_sections(config, host.registries)
    sections.update(plugin_config or {})
    ctx = ServerContext(config=config, host=host, engine=Engine(config, host), plugin_config=sections)
    app = build_app(ctx)
    # The API's own routes (the app adds /health, /metrics and maybe its schema): the factory's
    # router, built once more for the listing.
    router = host.registries.apis.get(name)(ctx)
    routes = [
        (method, route.path, route.path_parameters)
        for route in router.routes
        for method in sorted(getattr(route, "methods", ()))
        if method not in ("OPTIONS", "HEAD")
    ]
    assert routes, f"API {name!r} mounts no routes"
    public = {
        (method, route.path)
        for route in router.routes
        for handler in getattr(route, "route_handlers", ())
        if handler.opt.get(PUBLIC) is True
        for method in handler.http_methods
    }
    checked = []
    with TestClient(app) as client:
        _wait_ready(client)
        shapes: dict[str, Any] = {}
        for method, template, params in routes:
            path = template
            for param in params.values():
                path = path.replace("{" + param.full + "}", MODEL_NAME)
            label = f"{method} {template}"
            if (method, template) in public:
                assert method == "GET", f"{label} is public: only GET routes may be served without a key"
                reply = client.get(path, follow_redirects=False)
                assert reply.status_code < 400, f"{label} (public) answered {reply.status_code}"
                checked.append(f"{label} (public)")
                continue
            reply = client.request(method, path)
            assert reply.status_code == 401, f"{label} without an API key answered {reply.status_code}"
            shapes[f"{label} (401)"] = _error_shape(label, reply)
            authorized = {"Authorization": f"Bearer {API_KEY}"}
            if method == "GET":
                reply = client.get(path, headers=authorized)
                assert reply.status_code < 500 or reply.status_code == 501, (
                    f"{label} answered {reply.status_code}: {reply.text}"
                )
            elif method in ("POST", "PUT", "PATCH"):
                reply = client.request(
                    method, path, content=b"{not json",
                    headers={**authorized, "Content-Type": "application/json"},
                )
                # 501: a route the server declares but does not implement here.
                assert (400 <= reply.status_code < 500 and reply.status_code != 401) or (
                    reply.status_code == 501
                ), (
                    f"{label} answered a malformed body with {reply.status_code}: {reply.text}"
                )
                shapes[f"{label} ({reply.status_code})"] = _error_shape(label, reply)
            checked.append(label)
        # Every route of an API whose routes are all public answers no error: nothing to compare.
        first, *others = shapes.items() if shapes else [("", None)]
        for where, shape in others:
            assert shape == first[1], (
                f"API {name!r} answers errors in different shapes: {first[0]} {first[1]} "
                f"but {where} {shape}"
            )
    return checked


def _wait_ready(client: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = client.get("/health")
        if reply.status_code == 200:
            return
        if reply.json().get("status") == "failed":
            raise AssertionError(f"the engine failed to load the model: {reply.text}")
        time.sleep(0.05)
    raise AssertionError("the engine did not become ready")


def _error_shape(label: str, reply: Any) -> Any:
    try:
        body = reply.json()
    except json.JSONDecodeError:
        raise AssertionError(f"{label}: error body is not JSON: {reply.text!r}") from None
    assert isinstance(body, dict), f"{label}: error body is not a JSON object: {body!r}"
    assert not set(body) >= LITESTAR_ERROR_KEYS, (
        f"{label}: error body is Litestar's default {body!r}, not the API's own shape "
        "(mount mlxr_core.http.errors.exception_handlers on the router)"
    )
    return _skeleton(body)


def _skeleton(value: Any) -> Any:
    """The keys of nested objects; every other value is ``"*"`` (messages and codes vary)."""
    if isinstance(value, dict):
        return {key: _skeleton(item) for key, item in sorted(value.items())}
    return "*"
