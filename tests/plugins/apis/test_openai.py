"""The OpenAI API: wire shapes, validation and errors over a scripted engine (fast), then the real
engine on a tiny random GGUF model (generation, stops, seeds, disconnects)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, FakeTokenizer, ThreadedServer, make_ctx, wait_until

from mlxr_core.config.schema import Config, ModelConfig, SamplingConfig
from mlxr_core.engine.request import GenerationRequest, RequestHandle
from mlxr_core.errors import EngineStopped, Overloaded
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake: FakeEngine):
    with TestClient(build_app(make_ctx(fake))) as test_client:
        yield test_client


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list[Any]:
    assert text.endswith("\n\n")
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- shapes ----------------------------------------------------------------------------------------


def test_chat_completion(client: TestClient, fake: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json=chat(max_tokens=5))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake" and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "length", "logprobs": None}
    ]
    prompt = len(fake.requests[0].prompt_ids)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert body["system_fingerprint"].startswith("mlxr-")
    assert fake.requests[0].prompt_ids == FakeTokenizer().encode("<user>hi<assistant>", add_special_tokens=False)


def test_chat_stream_with_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat(max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == "Hell"
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_stream_without_usage_has_no_usage_field(client: TestClient) -> None:
    events = sse_events(client.post("/v1/chat/completions", json=chat(max_tokens=2, stream=True)).text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_completion_and_its_stream(client: TestClient, fake: FakeEngine) -> None:
    body = client.post("/v1/completions", json={"model": "fake", "prompt": ["Say"], "max_tokens": 3}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Hel", "finish_reason": "length", "logprobs": None}]
    assert fake.requests[-1].prompt_ids == [1, *b"Say"]
    r = client.post("/v1/completions", json={"model": "fake", "prompt": [5, 6, 7], "stream": True, "max_tokens": 3})
    events = sse_events(r.text)
    assert fake.requests[-1].prompt_ids == [5, 6, 7]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hel"
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_stop_strings_and_finish_reason_stop(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json=chat(stop=[",", "zz"], max_tokens=20)).json()
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_sampling_parameters_reach_the_engine(fake: FakeEngine) -> None:
    defaults = SamplingConfig(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    with TestClient(build_app(make_ctx(fake, sampling=defaults))) as client:
        client.post("/v1/chat/completions", json=chat())
        client.post("/v1/chat/completions", json=chat(
            temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=-1, stop=["a", "b"], max_completion_tokens=3,
            max_tokens=9, user="someone", frequency_penalty=0, unknown_field={"x": 1},
            messages=[{"role": "developer", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        ))
    first, second = (r.params for r in fake.requests)
    assert (first.temperature, first.top_p, first.top_k, first.min_p, first.seed) == (0.7, 0.9, 40, 0.05, None)
    assert first.max_tokens == 16  # engine's rule when the request sets none
    assert (second.temperature, second.top_p, second.top_k, second.min_p) == (0.0, 0.5, 0, 0.1)
    assert second.seed == 2**64 - 1 and second.stop == ["a", "b"] and second.max_tokens == 3 and second.extra == {}
    assert fake.requests[1].prompt_ids == FakeTokenizer().encode("<system>be brief<user>a\nb<assistant>", add_special_tokens=False)


def test_models(client: TestClient) -> None:
    listing = client.get("/v1/models").json()
    assert listing == {"object": "list", "data": [
        {"id": "fake", "created": 1700000000, "owned_by": "mlxr", "object": "model", "context_length": 64,
         "capabilities": ["completion"]}
    ]}
    assert client.get("/v1/models/fake").json()["id"] == "fake"
    r = client.get("/v1/models/org/missing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_say_what_each_model_takes(fake: FakeEngine) -> None:
    """Front ends (the web page among them) offer image upload and tools by ``capabilities``."""
    import attrs

    from mlxr_core.model.vision import ImageTokens

    fake.models["fake"] = attrs.evolve(
        fake.models["fake"], tool_parser="hermes", reasoning_parser="think",
        image_processor=lambda image: image, image_tokens=ImageTokens(1, 1, "<image>", "<image>"),
    )  # fmt: skip
    with TestClient(build_app(make_ctx(fake))) as client:
        (card,) = client.get("/v1/models").json()["data"]
        assert card["capabilities"] == ["completion", "tools", "vision", "thinking"]
        assert client.get("/v1/models/fake").json()["capabilities"] == card["capabilities"]
    fake.models["fake"] = attrs.evolve(fake.models["fake"], image_processor=None, tool_parser=None, reasoning_parser=None)
    with TestClient(build_app(make_ctx(fake))) as client:
        assert client.get("/v1/models/fake").json()["capabilities"] == ["completion"]


def test_the_official_client_reads_our_responses(client: TestClient) -> None:
    api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)  # type: ignore[arg-type]
    reply = api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert reply.choices[0].message.content == "Hello" and reply.usage and reply.usage.completion_tokens == 5
    stream = api.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert api.completions.create(model="fake", prompt="x", max_tokens=2).choices[0].text == "He"
    assert [m.id for m in api.models.list()] == ["fake"]
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=17)
    assert info.value.param == "n"  # type: ignore[attr-defined]


# -- bad input -------------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD_REQUESTS = [
    # (path, raw body, status, param or None)
    (CHAT, b'{"model": "fake", "messages": [', 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, json.dumps(chat(max_tokens="5")).encode(), 400, "max_tokens"),
    (CHAT, json.dumps(chat(stream="true")).encode(), 400, "stream"),
    (CHAT, json.dumps({"model": "fake"}).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "fake", "messages": [{"content": "x"}]}).encode(), 400, "messages[0].role"),
    (CHAT, json.dumps(chat(max_tokens=-3)).encode(), 400, "max_tokens"),
    (CHAT, json.dumps(chat(max_tokens=0)).encode(), 400, "max_tokens"),
    (CHAT, json.dumps(chat(temperature=2.5)).encode(), 400, "temperature"),
    (CHAT, json.dumps(chat(top_p=0)).encode(), 400, "top_p"),
    (CHAT, json.dumps(chat(seed=2**64)).encode(), 400, "seed"),
    (CHAT, json.dumps(chat(n=17)).encode(), 400, "n"),
    (CHAT, json.dumps(chat(n=0)).encode(), 400, "n"),
    (CHAT, json.dumps(chat(model="nope")).encode(), 404, "model"),
    (CHAT, json.dumps(chat(content="x" * 100)).encode(), 400, "messages"),
    (CHAT, json.dumps(chat(max_tokens=60)).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "fake", "messages": []}).encode(), 400, "messages"),
    (CHAT, json.dumps({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages[0].role"),
    (CHAT, json.dumps({"model": "fake", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}).encode(), 400, "messages[0].content[0].image_url"),
    (CHAT, json.dumps(chat(stop=["a"] * 17)).encode(), 400, "stop"),
    (CHAT, json.dumps(chat(stop=[""])).encode(), 400, "stop"),
    (CHAT, json.dumps(chat(stop="x" * 300)).encode(), 400, "stop"),
    (CHAT, json.dumps(chat(logprobs=True, top_logprobs=21)).encode(), 400, "top_logprobs"),
    (CHAT, json.dumps(chat(top_logprobs=2)).encode(), 400, "top_logprobs"),
    (CHAT, json.dumps(chat(logit_bias={"abc": 5})).encode(), 400, "logit_bias"),
    (CHAT, json.dumps(chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes")).encode(), 400, "tool_choice"),
    (CHAT, json.dumps(chat(response_format={"type": "yaml"})).encode(), 400, "response_format.type"),
    (CHAT, json.dumps(chat(response_format={"type": "json_schema"})).encode(), 400, "response_format"),
    (CHAT, json.dumps(chat(presence_penalty=2.5)).encode(), 400, "presence_penalty"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": "y", "logprobs": 21}).encode(), 400, "logprobs"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": [{"x": 1}]}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": [1, 999]}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": "y" * 100}).encode(), 400, "prompt"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": "y", "echo": True}).encode(), 400, "echo"),
    (COMPLETIONS, json.dumps({"model": "fake", "prompt": 5}).encode(), 400, "prompt"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    client: TestClient, path: str, raw: bytes, status: int, param: str | None
) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in error["message"]
    assert client.post(CHAT, json=chat(max_tokens=2)).json()["choices"][0]["message"]["content"] == "He"


def test_overloaded_is_429_with_retry_after(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = Overloaded("64 requests are waiting; retry later")
    r = client.post(CHAT, json=chat())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("state", ["loading", "failed", "stopping", "stopped"])
def test_engine_not_ready_is_503(client: TestClient, fake: FakeEngine, state: str) -> None:
    fake.state = state
    fake.error = RuntimeError("bad file") if state == "failed" else None
    for r in (client.post(CHAT, json=chat()), client.get("/v1/models")):
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "server_error"


def test_engine_stopped_on_submit_is_503(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = EngineStopped("the engine is stopping; not accepting requests")
    assert client.post(COMPLETIONS, json={"model": "fake", "prompt": "x"}).status_code == 503


def test_a_bug_is_a_bare_500(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = ZeroDivisionError("secret internals")
    r = client.post(CHAT, json=chat())
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
    fake.raise_on_submit = None
    assert client.post(CHAT, json=chat(max_tokens=1)).status_code == 200


def test_generation_failure(client: TestClient, fake: FakeEngine) -> None:
    fake.fail_after = 2
    r = client.post(CHAT, json=chat())
    assert r.status_code == 500 and r.json()["error"]["message"] == "generation failed: boom"
    events = sse_events(client.post(CHAT, json=chat(stream=True)).text)
    assert events[-2] == {"error": {"message": "generation failed: boom", "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"


def test_unknown_route_and_method(client: TestClient) -> None:
    assert client.get("/v1/chat/completions").status_code == 405
    assert client.post("/v1/nothing", json={}).status_code == 404


# -- disconnects, over a real socket ---------------------------------------------------------------


def test_a_client_leaving_a_stream_cancels_its_request(fake: FakeEngine) -> None:
    fake.endless = True
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(stream=True)) as r:
            lines = r.iter_lines()
            received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert wait_until(lambda: fake.handles[0].cancelled), "the request kept generating"
        fake.endless = False
        assert httpx.post(f"{url}/v1/chat/completions", json=chat(max_tokens=2)).json()["choices"][0]["message"]["content"] == "He"


def test_a_client_leaving_a_non_streaming_request_cancels_it(fake: FakeEngine) -> None:
    fake.endless = True
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "x"}, timeout=0.3)
        assert wait_until(lambda: fake.handles[0].cancelled), "the request kept generating"


# -- the real engine on a tiny random model ---------------------------------------------------------


def start_tiny_engine(path: Any, context_length: int) -> tuple[Config, Any, Any]:
    from mlxr_core.engine.engine import Engine

    config = Config(models=[ModelConfig(path=str(path), name="tiny", context_length=context_length)])
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    return config, host, engine


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_path: Any):
    config, host, engine = start_tiny_engine(tiny_path, context_length=128)
    try:
        with TestClient(build_app(ServerContext(config=config, host=host, engine=engine))) as test_client:
            yield test_client
    finally:
        engine.stop()


def tiny_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "the wine"}], "temperature": 0, **extra}


def streamed_text(events: list[Any], key: str) -> str:
    return "".join(
        (e["choices"][0]["delta"].get("content", "") if key == "chat" else e["choices"][0]["text"])
        for e in events[:-1] if e["choices"]
    )


def test_tiny_greedy_chat_streamed_equals_whole(tiny: TestClient) -> None:
    whole = tiny.post(CHAT, json=tiny_chat(max_tokens=12, ignore_eos=True)).json()
    text = whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 12
    events = sse_events(tiny.post(CHAT, json=tiny_chat(
        max_tokens=12, ignore_eos=True, stream=True, stream_options={"include_usage": True})).text)
    assert streamed_text(events, "chat") == text
    streamed = events[-2]["usage"]
    # the same prompt again: all of it but the token that starts decoding came from the prefix cache
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert streamed.pop("prompt_tokens_details") == {"cached_tokens": whole["usage"]["prompt_tokens"] - 1}
    assert streamed == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}


def test_tiny_completion(tiny: TestClient) -> None:
    body = tiny.post(COMPLETIONS, json={"model": "tiny", "prompt": "the", "max_tokens": 8, "temperature": 0,
                                         "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    events = sse_events(tiny.post(COMPLETIONS, json={"model": "tiny", "prompt": "the", "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True, "stream": True}).text)
    assert streamed_text(events, "completion") == body["choices"][0]["text"]


def test_tiny_stop_strings(tiny: TestClient) -> None:
    text = tiny.post(CHAT, json=tiny_chat(max_tokens=24, ignore_eos=True)).json()["choices"][0]["message"]["content"]
    assert len(text) > 4, "the tiny model must produce some text for this test"
    stop = text[2:4]
    for stream in (False, True):
        r = tiny.post(CHAT, json=tiny_chat(max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"], stream=stream))
        if stream:
            events = sse_events(r.text)
            stopped, reason = streamed_text(events, "chat"), events[-2]["choices"][0]["finish_reason"]
        else:
            stopped, reason = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        assert stopped == text[: text.index(stop)] and reason == "stop"


def test_tiny_seeded_sampling_is_reproducible(tiny: TestClient) -> None:
    def sample(seed: int) -> str:
        body = tiny_chat(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return str(tiny.post(CHAT, json=body).json()["choices"][0]["message"]["content"])

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_tiny_bad_requests_then_success(tiny: TestClient) -> None:
    long_chat = tiny_chat(messages=[{"role": "user", "content": "the wine " * 200}])
    cases = [
        (CHAT, long_chat, 400, "messages"),
        (COMPLETIONS, {"model": "tiny", "prompt": "the wine " * 200}, 400, "prompt"),
        (CHAT, tiny_chat(max_tokens=127), 400, "messages"),
        (CHAT, tiny_chat(max_tokens=-1), 400, "max_tokens"),
        (CHAT, tiny_chat(n=17), 400, "n"),
        (CHAT, tiny_chat(logit_bias={"100000": 5}), 400, "logit_bias"),
        (CHAT, tiny_chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
        (CHAT, tiny_chat(model="other"), 404, "model"),
        (CHAT, tiny_chat(temperature="hot"), 400, "temperature"),
    ]
    for path, body, status, param in cases:
        r = tiny.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
        ok = tiny.post(CHAT, json=tiny_chat(max_tokens=2, ignore_eos=True))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    r = tiny.post(CHAT, json=long_chat)
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_tiny_disconnect_frees_the_engine(tiny_path: Any) -> None:
    config, host, engine = start_tiny_engine(tiny_path, context_length=4096)
    handles: list[RequestHandle] = []
    submit = engine.submit

    def recording_submit(request: GenerationRequest, *, loop: Any = None) -> RequestHandle:
        handles.append(submit(request, loop=loop))
        return handles[-1]

    engine.submit = recording_submit
    try:
        with ThreadedServer(build_app(ServerContext(config=config, host=host, engine=engine))) as url:
            body = tiny_chat(max_tokens=4000, ignore_eos=True, stream=True)
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                [next(lines) for _ in range(6)]
            left = time.monotonic()
            assert wait_until(lambda: engine.running == 0, timeout=5), "the engine kept generating"
            assert handles[0].cancelled and time.monotonic() - left < 5
            ok = httpx.post(f"{url}/v1/chat/completions", json=tiny_chat(max_tokens=3, ignore_eos=True), timeout=10)
            assert ok.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.stop()


# -- logprobs, n, penalties and logit_bias on the tiny engine ---------------------------------


def test_tiny_chat_logprobs_whole_and_streamed(tiny: TestClient) -> None:
    import math

    body = tiny_chat(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    whole = tiny.post(CHAT, json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 == whole["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        # Greedy: the emitted token is the most likely one.
        assert math.isclose(entry["logprob"], entry["top_logprobs"][0]["logprob"], abs_tol=1e-5)
        assert entry["token"] == entry["top_logprobs"][0]["token"]
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        probs = [math.exp(alt["logprob"]) for alt in entry["top_logprobs"]]
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-5
    assert "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in content) == whole["choices"][0]["message"]["content"]
    streamed = sse_events(tiny.post(CHAT, json={**body, "stream": True}).text)
    pieces = [e for e in streamed[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    assert [x for e in pieces for x in e["choices"][0]["logprobs"]["content"]] == content


def test_tiny_completion_logprobs_have_offsets(tiny: TestClient) -> None:
    body = {"model": "tiny", "prompt": "the wine", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    choice = tiny.post(COMPLETIONS, json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]
    assert logprobs["text_offset"] == offsets
    assert all(len(top) <= 2 and token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))
    streamed = sse_events(tiny.post(COMPLETIONS, json={**body, "stream": True}).text)
    tokens = [t for e in streamed[:-1] if e["choices"] and e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets_streamed = [o for e in streamed[:-1] if e["choices"] and e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == logprobs["tokens"] and offsets_streamed == offsets


def test_tiny_n_choices_are_seeded_apart_and_usage_counts_them_all(tiny: TestClient) -> None:
    body = tiny_chat(max_tokens=8, ignore_eos=True, n=3, temperature=1.0, seed=5)
    whole = tiny.post(CHAT, json=body).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert whole["usage"]["completion_tokens"] == 24
    assert tiny.post(CHAT, json=body).json()["choices"] == whole["choices"]  # reproducible
    # Choice 0 is the request's own seed: the same as n=1.
    single = tiny.post(CHAT, json={**body, "n": 1}).json()["choices"][0]["message"]["content"]
    assert single == texts[0]
    events = sse_events(tiny.post(CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}).text)
    by_index: dict[int, str] = {}
    finished = set()
    for event in events[:-1]:
        for choice in event["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert [by_index[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert events[-2]["usage"]["completion_tokens"] == 24
    completions = tiny.post(COMPLETIONS, json={"model": "tiny", "prompt": "the", "max_tokens": 4, "n": 2,
                                               "ignore_eos": True}).json()
    assert [c["index"] for c in completions["choices"]] == [0, 1]
    assert completions["usage"]["completion_tokens"] == 8


def test_tiny_penalties_and_logit_bias_reach_the_sampler(tiny: TestClient) -> None:
    def greedy(**extra: Any) -> list[bytes]:
        r = tiny.post(CHAT, json=tiny_chat(max_tokens=40, ignore_eos=True, logprobs=True, **extra))
        assert r.status_code == 200, r.text
        return [bytes(entry["bytes"]) for entry in r.json()["choices"][0]["logprobs"]["content"]]

    def most_repeated(tokens: list[bytes]) -> int:
        return max(tokens.count(t) for t in tokens)

    plain = greedy()
    # A large bias on one token makes greedy decoding pick it every time.
    forced = greedy(logit_bias={"100": 100})
    assert forced == [forced[0]] * 40 and forced != plain
    # Greedy decoding of the random model loops; penalties on repeats break the loop.
    assert most_repeated(plain) > 3
    assert most_repeated(greedy(frequency_penalty=2.0, presence_penalty=2.0)) < most_repeated(plain)
    assert most_repeated(greedy(repetition_penalty=3.0)) < most_repeated(plain)
