"""Operations across the APIs: API keys (401 in each API's shape), /metrics, request ids and the
access log, the body size limit, the max_tokens cap, CORS, and draining at shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families
from scripted import FakeEngine, make_ctx, wait_until

from mlxr_core.config.schema import ServerConfig
from mlxr_core.http.access import ApiKeys, Unauthorized, owner_id
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app, drain, end_now

KEY = "sk-test-0123456789"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
OLLAMA_CHAT = {**CHAT, "stream": False}
ANTHROPIC = {"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
#: One generating route per API, and how each API shapes a 401.
API_CALLS = [
    ("/v1/chat/completions", CHAT, lambda b: b["error"]["code"] == "invalid_api_key" and b["error"]["type"] == "invalid_request_error"),
    ("/api/chat", OLLAMA_CHAT, lambda b: set(b) == {"error"} and "API key" in b["error"]),
    ("/v1/messages", ANTHROPIC, lambda b: b["type"] == "error" and b["error"]["type"] == "authentication_error"),
]


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


def app_client(fake: FakeEngine, **server: Any) -> TestClient:
    return TestClient(build_app(make_ctx(fake, server=ServerConfig(**server))))


# -- API keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "is_api_shape"), API_CALLS)
def test_a_missing_or_wrong_key_is_a_401_in_the_apis_shape(fake: FakeEngine, path: str, body: Any, is_api_shape: Any) -> None:
    with app_client(fake, api_keys=[KEY, "another-key"]) as client:
        for headers in ({}, {"authorization": "Bearer nope"}, {"x-api-key": "nope"}, {"authorization": f"Basic {KEY}"},
                        {"authorization": "Bearer "}):
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 401 and is_api_shape(r.json()), (headers, r.text)
        for headers in ({"authorization": f"Bearer {KEY}"}, {"Authorization": f"bearer {KEY}"},
                        {"x-api-key": "another-key"}, {"authorization": "Bearer nope", "x-api-key": KEY}):
            assert client.post(path, json=body, headers=headers).status_code == 200, headers
    assert len(fake.requests) == 4  # the refused requests never reached the engine


def test_health_and_metrics_are_exempt_by_default_and_can_be_protected(fake: FakeEngine) -> None:
    with app_client(fake, api_keys=[KEY]) as client:
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401 and client.get("/api/tags").status_code == 401
    with app_client(fake, api_keys=[KEY], auth_exempt=[]) as client:
        r = client.get("/health")
        assert r.status_code == 401 and "API key" in r.json()["error"]
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    with app_client(fake) as client:  # no keys: no authentication
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_api_keys_compare_whole_keys() -> None:
    keys = ApiKeys([KEY, "b"])
    assert keys.matches(KEY) and keys.matches("b")
    assert not any(keys.matches(k) for k in (KEY[:-1], KEY + "x", "", "B", " b"))
    assert not ApiKeys([]).enabled
    with pytest.raises(Unauthorized, match="missing API key"):
        keys.check("/v1/models", {})
    keys.check("/v1/models", {"x-api-key": f" {KEY} "})  # surrounding whitespace is not part of a key


def test_a_key_is_known_to_stored_data_by_a_hash_of_its_own() -> None:
    keys = ApiKeys([KEY, "b"], exempt=["/health"])
    owner = keys.check("/v1/responses", {"authorization": f"Bearer {KEY}"})
    assert owner == owner_id(KEY) and KEY not in str(owner)
    assert keys.check("/v1/responses", {"x-api-key": "b"}) == owner_id("b") != owner
    # a wrong bearer beside a right x-api-key: the key that matched
    assert keys.check("/v1/responses", {"authorization": "Bearer nope", "x-api-key": "b"}) == owner_id("b")
    assert keys.check("/health", {}) is None and ApiKeys([]).check("/v1/responses", {}) is None


def test_official_clients_send_keys_their_way(fake: FakeEngine) -> None:
    from scripted import ThreadedServer

    with ThreadedServer(build_app(make_ctx(fake, server=ServerConfig(api_keys=[KEY])))) as url:
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        turn: Any = [{"role": "user", "content": "hi"}]
        assert anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
            model="fake", max_tokens=2, messages=turn).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="fake", max_tokens=2, messages=turn)


# -- metrics ---------------------------------------------------------------------------------------


def scrape(client: TestClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_requests_tokens_and_latencies(fake: FakeEngine) -> None:
    with app_client(fake) as client:
        before = scrape(client)
        assert value(before, "mlxr_engine_state", state="ready") == 1.0
        assert value(before, "mlxr_http_requests_total", method="POST", endpoint="/v1/chat/completions", status="200") == 0
        client.post("/v1/chat/completions", json=CHAT)
        client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        client.post("/api/chat", json={**OLLAMA_CHAT, "options": {"num_predict": 4}})
        client.post("/v1/messages", json=ANTHROPIC)
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0})
        client.get("/no/such/route")
        after = scrape(client)
    http = "mlxr_http_requests_total"
    assert value(after, http, method="POST", endpoint="/v1/chat/completions", status="200") == 2
    assert value(after, http, method="POST", endpoint="/v1/chat/completions", status="400") == 1
    assert value(after, http, method="POST", endpoint="/api/chat", status="200") == 1
    assert value(after, http, method="POST", endpoint="/v1/messages", status="200") == 1
    assert value(after, http, method="GET", endpoint="unmatched", status="404") == 1
    prompt = sum(len(r.prompt_ids) for r in fake.requests)
    assert value(after, "mlxr_prompt_tokens_total", model="fake") == prompt
    assert value(after, "mlxr_generation_tokens_total", model="fake") == 3 + 3 + 4 + 3
    assert value(after, "mlxr_requests_finished_total", model="fake", reason="length") == 4
    assert value(after, "mlxr_time_to_first_token_seconds_count", model="fake") == 4
    assert value(after, "mlxr_inter_token_latency_seconds_count", model="fake") == 2 + 2 + 3 + 2
    assert value(after, "mlxr_requests_inflight") == 0 and value(after, "mlxr_requests_running") == 0


def test_metrics_show_running_requests(fake: FakeEngine) -> None:
    from scripted import ThreadedServer

    fake.endless = True
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.iter_lines()  # kept: dropping the iterator closes the connection
            next(lines)
            samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                       for s in f.samples if not s.labels}
        assert samples["mlxr_requests_inflight"] == 1 and samples["mlxr_requests_running"] == 1
        assert samples["mlxr_kv_cache_bytes"] == 1024
        assert wait_until(lambda: fake.running == 0)


# -- request ids and the access log ---------------------------------------------------------------


def test_each_request_gets_an_id_and_one_access_log_line(fake: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mlxr.access"), app_client(fake) as client:
        r = client.post("/v1/chat/completions", json=CHAT)
        own = client.get("/health", headers={"x-request-id": "trace-42"})
        hostile = client.get("/health", headers={"x-request-id": "a b\nc"})
        client.get("/missing")
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    assert own.headers["x-request-id"] == "trace-42"
    assert hostile.headers["x-request-id"] != "a b\nc" and len(hostile.headers["x-request-id"]) == 32
    lines = [record.getMessage() for record in caplog.records if record.name == "mlxr.access"]
    assert len(lines) == 4
    assert lines[0].startswith(f"{generated} ") and " POST /v1/chat/completions 200 " in lines[0]
    assert lines[1].startswith("trace-42 ") and " GET /health 200 " in lines[1]
    assert " GET /missing 404 " in lines[3]


def test_a_post_counts_as_arriving_until_it_is_submitted_or_answered(fake: FakeEngine) -> None:
    """The outermost middleware counts each POST in the engine's arrivals (so an idle engine can
    wait for a burst still being read and tokenized) and out once submitted, or answered without
    being submitted (a 4xx), or ended; GETs are not counted."""
    with app_client(fake) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert fake.arriving_at_submit == [1]  # counted while it was read, up to its submit
        assert fake.arrivals.pending == 0
        assert client.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}).status_code == 400
        assert client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
        client.get("/health")
        assert fake.arrivals.pending == 0
        assert client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert fake.arriving_at_submit == [1, 1]
        assert fake.arrivals.pending == 0


def test_the_access_log_can_be_turned_off(fake: FakeEngine, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mlxr.access"), app_client(fake, access_log=False) as client:
        assert client.get("/health").headers["x-request-id"]
    assert not [record for record in caplog.records if record.name == "mlxr.access"]


# -- limits and CORS -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_in_each_apis_shape(fake: FakeEngine) -> None:
    padding = {"user": "x" * 500}
    with app_client(fake, max_body_bytes=300) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, **padding})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        r = client.post("/api/chat", json={**OLLAMA_CHAT, **padding})
        assert r.status_code == 413 and set(r.json()) == {"error"}
        r = client.post("/v1/messages", json={**ANTHROPIC, **padding})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(fake.requests) == 1


def test_max_tokens_cap_lowers_every_apis_max_tokens(fake: FakeEngine) -> None:
    with app_client(fake, max_tokens_cap=2) as client:
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40}).json()["usage"]["completion_tokens"] == 2
        client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        client.post("/api/generate", json={"model": "fake", "prompt": "x", "stream": False, "options": {"num_predict": 9}})
        client.post("/v1/messages", json={**ANTHROPIC, "max_tokens": 9})
    assert [r.params.max_tokens for r in fake.requests] == [2, 2, 2, 2]


def test_cors_is_off_unless_origins_are_configured(fake: FakeEngine) -> None:
    origin = {"origin": "http://localhost:3000"}
    with app_client(fake) as client:
        assert "access-control-allow-origin" not in client.get("/health", headers=origin).headers
    with app_client(fake, cors_origins=["http://localhost:3000"]) as client:
        assert client.get("/health", headers=origin).headers["access-control-allow-origin"] == "http://localhost:3000"


# -- draining at shutdown --------------------------------------------------------------------------


class DrainingServer:
    """uvicorn in a thread, stopped the way ``mlxr serve`` stops on SIGTERM (minus the signal)."""

    def __init__(self, ctx: ServerContext):
        import uvicorn

        from mlxr_core.cli.serve import _graceful_server_class

        config = uvicorn.Config(build_app(ctx), host="127.0.0.1", port=0, log_level="warning")
        self.server = _graceful_server_class()(
            config, drain=lambda: drain(ctx, ctx.config.server.shutdown_timeout), end_now=lambda: end_now(ctx)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=10)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"


def test_shutdown_lets_short_requests_finish_and_ends_long_ones_with_an_error() -> None:
    fake = FakeEngine(context_length=256)
    fake.token_delay_s = 0.05  # the 26-character reply takes ~1.3 s; shutdown_timeout is 0.4 s
    ctx = make_ctx(fake, server=ServerConfig(shutdown_timeout=0.4))
    server = DrainingServer(ctx)
    url = server.start()
    results: dict[str, Any] = {}

    def call(name: str, path: str, body: dict[str, Any]) -> None:
        with httpx.Client(timeout=10) as http:
            r = http.post(f"{url}{path}", json=body)
            results[name] = (r.status_code, r.text)

    calls = {
        "short": ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "stream": True}),
        "openai": ("/v1/chat/completions", {**CHAT, "max_tokens": 60, "stream": True}),
        "ollama": ("/api/chat", {**CHAT, "options": {"num_predict": 60}}),
        "anthropic": ("/v1/messages", {**ANTHROPIC, "max_tokens": 60, "stream": True}),
        "whole": ("/v1/chat/completions", {**CHAT, "max_tokens": 60}),
    }
    threads = [threading.Thread(target=call, args=(name, *args)) for name, args in calls.items()]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: len(fake.handles) == len(calls))
    started = time.monotonic()
    server.server.should_exit = True
    for thread in threads:
        thread.join(10)
    server.thread.join(10)
    assert not server.thread.is_alive() and time.monotonic() - started < 3
    assert results["short"][0] == 200 and '"finish_reason":"length"' in results["short"][1]
    assert results["short"][1].endswith("data: [DONE]\n\n")
    shutting_down = "shutting down"
    openai_events = results["openai"][1].strip().split("\n\n")
    assert shutting_down in json.loads(openai_events[-2].removeprefix("data: "))["error"]["message"]
    assert shutting_down in json.loads(results["ollama"][1].splitlines()[-1])["error"]
    assert results["anthropic"][1].strip().split("\n\n")[-1].startswith("event: error")
    assert results["whole"][0] == 503 and shutting_down in results["whole"][1]
    assert all(handle.cancelled for handle in fake.handles[1:])


def test_a_draining_server_refuses_new_requests(fake: FakeEngine) -> None:
    ctx = make_ctx(fake)
    with TestClient(build_app(ctx)) as client:
        asyncio.run(drain(ctx, 1.0))
        for path, body, _ in API_CALLS:
            assert client.post(path, json=body).status_code == 503
    assert fake.requests == []
