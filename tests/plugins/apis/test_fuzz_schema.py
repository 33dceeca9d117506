"""Property-based fuzzing of every route the app's OpenAPI document lists, with schemathesis.

The app mounts every built-in API over the real engine serving a tiny random GGUF model, with
``server.max_tokens_cap`` keeping each generation to a few tokens. Schemathesis generates bodies
both valid and invalid for each route's schema and checks every reply: never a 5xx, never a hang
(each call has a read timeout), a status, content type and body that the document allows, and
invalid bodies refused with a 4xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from mlxr_core.config.schema import Config, ModelConfig, ServerConfig  # noqa: E402
from mlxr_core.engine.engine import Engine  # noqa: E402
from mlxr_core.http.context import ServerContext  # noqa: E402
from mlxr_core.http.server import build_app  # noqa: E402
from mlxr_core.plugins import load_plugins  # noqa: E402

#: Generated cases per route and generation mode; the whole module stays within CI time.
MAX_EXAMPLES = 20
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
def fuzzed_app(tiny_model_path: Path) -> Iterator[Any]:
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=128)],
        apis=["openai", "ollama", "anthropic"],
        server=ServerConfig(max_tokens_cap=4, access_log=False),
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        yield without_lifespan(build_app(ServerContext(config=config, host=host, engine=engine)))
    finally:
        engine.stop()


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
    """Send half of the generated requests to the served model, so that they reach generation."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2 == 0:
        return {**body, "model": "tiny"}
    return body


def fuzz(operation: Any, mode: GenerationMode) -> None:
    """Run ``MAX_EXAMPLES`` generated cases of ``mode`` against ``operation``."""

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

    try:
        check()
    except Unsatisfiable:
        if mode == GenerationMode.POSITIVE:
            raise  # a route without inputs has no invalid requests, but it always has valid ones


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_every_route_survives_fuzzing(api_schema: Any, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10  # every API's routes are in the document
    failures = []
    for operation in operations:
        try:
            fuzz(operation, mode)
        except Exception as exc:  # collect every route's failure, not just the first
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
