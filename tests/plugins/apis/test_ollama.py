"""The Ollama API: wire shapes, options, validation and errors over a scripted engine (fast), the
official ``ollama`` client over a real socket, then the real engine on a tiny random GGUF model."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import ollama
import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, FakeTokenizer, ThreadedServer, make_ctx, wait_until

from mlxr_core.config.schema import SamplingConfig, ServerConfig
from mlxr_core.errors import EngineStopped, Overloaded
from mlxr_core.http.server import build_app

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
COUNTERS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake: FakeEngine):
    with TestClient(build_app(make_ctx(fake))) as test_client:
        yield test_client


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}


def ndjson(text: str) -> list[dict[str, Any]]:
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# -- shapes ----------------------------------------------------------------------------------------


def test_chat_whole(client: TestClient, fake: FakeEngine) -> None:
    r = client.post("/api/chat", json=chat(stream=False, options={"num_predict": 5}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["model"] == "fake" and RFC3339.match(body["created_at"])
    assert body["message"] == {"role": "assistant", "content": "Hello"}
    assert body["done"] is True and body["done_reason"] == "length"
    assert body["eval_count"] == 5 and body["prompt_eval_count"] == len(fake.requests[0].prompt_ids)
    assert all(isinstance(body[key], int) and body[key] >= 0 for key in COUNTERS)
    assert body["total_duration"] >= body["load_duration"]
    assert fake.requests[0].prompt_ids == FakeTokenizer().encode("<user>hi<assistant>", add_special_tokens=False)


def test_chat_streams_ndjson_by_default(client: TestClient) -> None:
    r = client.post("/api/chat", json=chat(options={"num_predict": 4}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r.text)
    assert [line["done"] for line in lines] == [False] * 4 + [True]
    assert "".join(line["message"]["content"] for line in lines) == "Hell"
    assert all(line["message"]["role"] == "assistant" and RFC3339.match(line["created_at"]) for line in lines)
    assert "done_reason" not in lines[0] and "eval_count" not in lines[0]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 4
    assert all(key in lines[-1] for key in COUNTERS)


def test_generate_whole_and_streamed_with_context(client: TestClient, fake: FakeEngine) -> None:
    body = client.post("/api/generate", json={"model": "fake", "prompt": "Say", "stream": False,
                                               "options": {"num_predict": 3}}).json()
    assert body["response"] == "Hel" and body["done"] is True and body["done_reason"] == "length"
    prompt = FakeTokenizer().encode("<user>Say<assistant>", add_special_tokens=False)
    assert fake.requests[-1].prompt_ids == prompt
    assert body["context"] == [*prompt, *b"Hel"]
    # A follow-up continues from the returned context.
    lines = ndjson(client.post("/api/generate", json={
        "model": "fake", "prompt": "More", "context": body["context"], "options": {"num_predict": 2}}).text)
    assert fake.requests[-1].prompt_ids == [*body["context"], *FakeTokenizer().encode("<user>More<assistant>", add_special_tokens=False)]
    assert "".join(line["response"] for line in lines) == "He"
    assert lines[-1]["context"] == [*fake.requests[-1].prompt_ids, *b"He"]


def test_generate_system_and_raw(client: TestClient, fake: FakeEngine) -> None:
    client.post("/api/generate", json={"model": "fake", "prompt": "p", "system": "s", "stream": False})
    assert fake.requests[-1].prompt_ids == FakeTokenizer().encode("<system>s<user>p<assistant>", add_special_tokens=False)
    client.post("/api/generate", json={"model": "fake", "prompt": "p", "system": "s", "raw": True, "stream": False})
    assert fake.requests[-1].prompt_ids == [1, *b"p"]


def test_empty_chat_or_prompt_loads_the_model(client: TestClient, fake: FakeEngine) -> None:
    body = client.post("/api/chat", json={"model": "fake", "messages": []}).json()
    assert body["done"] is True and body["done_reason"] == "load" and body["message"]["content"] == ""
    body = client.post("/api/generate", json={"model": "fake:latest"}).json()
    assert body["done"] is True and body["done_reason"] == "load" and body["response"] == ""
    assert fake.requests == []
    # a load request's options, format and tools are checked as any request's
    bad = client.post("/api/generate", json={"model": "fake", "options": {"stop": ["x" * 100_000]}})
    assert bad.status_code == 400 and "options.stop" in bad.text
    bad = client.post("/api/chat", json={"model": "fake", "messages": [], "tools": [{"x": 1}]})
    assert bad.status_code == 400, bad.text


def test_options_map_to_sampling_and_unknown_ones_are_ignored(fake: FakeEngine) -> None:
    defaults = SamplingConfig(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    with TestClient(build_app(make_ctx(fake, sampling=defaults))) as client:
        client.post("/api/chat", json=chat(stream=False))
        client.post("/api/chat", json=chat(stream=False, options={
            "temperature": 0, "top_p": 0.5, "top_k": 0, "min_p": 0.1, "seed": 42, "stop": ["x", "y"],
            "num_predict": 3, "num_ctx": 4096, "mirostat": 2, "repeat_penalty": 1.1, "no_such_option": [1],
            "presence_penalty": 0.5, "frequency_penalty": 9.0,
        }))
        client.post("/api/chat", json=chat(stream=False, options={"seed": -1, "top_k": -5, "stop": "z"}))
    first, second, third = (r.params for r in fake.requests)
    assert (first.temperature, first.top_p, first.top_k, first.min_p, first.seed) == (0.7, 0.9, 40, 0.05, None)
    assert first.max_tokens == 16  # the engine's default when num_predict is unset
    assert (second.temperature, second.top_p, second.top_k, second.min_p, second.seed) == (0.0, 0.5, 0, 0.1, 42)
    assert second.stop == ["x", "y"] and second.max_tokens == 3 and second.extra == {}
    assert (second.repetition_penalty, second.presence_penalty, second.frequency_penalty) == (1.1, 0.5, 2.0)
    assert (first.repetition_penalty, first.presence_penalty, first.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (third.seed, third.top_k, third.stop) == (None, 0, ["z"])


def test_num_predict_fills_the_context_and_respects_the_cap(fake: FakeEngine) -> None:
    with TestClient(build_app(make_ctx(fake))) as client:
        for num_predict in (-1, -2, 1000):
            client.post("/api/chat", json=chat(stream=False, options={"num_predict": num_predict}))
    room = 64 - len(fake.requests[0].prompt_ids)
    assert [r.params.max_tokens for r in fake.requests] == [room, room, room]
    capped = FakeEngine()
    with TestClient(build_app(make_ctx(capped, server=ServerConfig(max_tokens_cap=4)))) as client:
        client.post("/api/chat", json=chat(stream=False, options={"num_predict": -1}))
        client.post("/api/chat", json=chat(stream=False))
    assert [r.params.max_tokens for r in capped.requests] == [4, 4]


def test_stop_option_ends_with_done_reason_stop(client: TestClient) -> None:
    body = client.post("/api/chat", json=chat(stream=False, options={"stop": [","]})).json()
    assert body["message"]["content"] == "Hello" and body["done_reason"] == "stop"


def test_tags_show_ps_version(client: TestClient) -> None:
    tags = client.get("/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["fake"] and tags[0]["model"] == "fake"
    assert re.fullmatch(r"[0-9a-f]{64}", tags[0]["digest"]) and RFC3339.match(tags[0]["modified_at"])
    assert tags[0]["details"]["family"] == "fake" and tags[0]["details"]["format"] == "fake"
    show = client.post("/api/show", json={"model": "fake"}).json()
    assert show["template"] == FakeTokenizer.chat_template and show["capabilities"] == ["completion"]
    assert show["model_info"]["fake.context_length"] == 64
    assert client.post("/api/show", json={"name": "fake:latest"}).status_code == 200
    ps = client.get("/api/ps").json()["models"]
    assert ps[0]["name"] == "fake" and ps[0]["context_length"] == 64 and ps[0]["digest"] == tags[0]["digest"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", client.get("/api/version").json()["version"])


def test_show_names_the_model_capabilities_and_size_and_ps_its_weights_bytes(fake: FakeEngine) -> None:
    import attrs

    from mlxr_core.model.vision import ImageTokens

    info = fake.models["fake"]
    fake.models["fake"] = attrs.evolve(
        info, parameters=134_515_008, nbytes=98_000_000, tool_parser="hermes", reasoning_parser="think",
        image_processor=lambda image: image, image_tokens=ImageTokens(1, 1, "<image>", "<image>"),
    )  # fmt: skip
    with TestClient(build_app(make_ctx(fake))) as client:
        show = client.post("/api/show", json={"model": "fake"}).json()
        assert show["capabilities"] == ["completion", "tools", "vision", "thinking"]
        assert show["details"]["parameter_size"] == "134.52M"
        assert show["model_info"]["general.parameter_count"] == 134_515_008
        assert client.get("/api/tags").json()["models"][0]["details"]["parameter_size"] == "134.52M"
        # /api/ps: the weights' bytes, not the budget's KV and prefix cache reserve
        assert client.get("/api/ps").json()["models"][0]["size"] == 98_000_000


def test_parameter_count_counts_packed_weights_as_the_values_they_hold() -> None:
    import mlx.nn as nn

    from mlxr_core.model.quantize import parameter_count

    dense = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
    assert parameter_count(dense) == 64 * 32 + 32 * 64 + 64
    nn.quantize(dense, group_size=32, bits=4)
    assert parameter_count(dense) == 64 * 32 + 32 * 64 + 64


# -- bad input -------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (path, raw body, status, words the error must contain)
    ("/api/chat", b'{"model": "fake", "messages": [', 400, "not valid JSON"),
    ("/api/chat", b"", 400, "empty"),
    ("/api/chat", json.dumps({"messages": []}).encode(), 400, "missing required field `model`"),
    ("/api/chat", json.dumps({"model": "", "messages": []}).encode(), 400, "model"),
    ("/api/chat", json.dumps(chat(model="nope")).encode(), 404, "not found"),
    ("/api/chat", json.dumps(chat(options={"temperature": "hot"})).encode(), 400, "options.temperature"),
    ("/api/chat", json.dumps(chat(options={"temperature": 3})).encode(), 400, "options.temperature"),
    ("/api/chat", json.dumps(chat(options={"num_predict": -3})).encode(), 400, "options.num_predict"),
    ("/api/chat", json.dumps(chat(options={"stop": [""]})).encode(), 400, "options.stop"),
    ("/api/chat", json.dumps(chat(options=[1])).encode(), 400, "options"),
    ("/api/chat", json.dumps(chat(stream="yes")).encode(), 400, "stream"),
    ("/api/chat", json.dumps(chat(tools=[{"type": "function"}])).encode(), 400, "tools"),
    ("/api/chat", json.dumps(chat(format="xml")).encode(), 400, "format"),
    ("/api/chat", json.dumps(chat(think="")).encode(), 400, "think"),
    ("/api/generate", json.dumps({"model": "fake", "prompt": "x", "think": True}).encode(), 400, "thinking"),
    ("/api/chat", json.dumps({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages[0].role"),
    ("/api/chat", json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}).encode(), 400, "images"),
    ("/api/chat", json.dumps(chat(content="x" * 100)).encode(), 400, "context length"),
    ("/api/generate", json.dumps({"model": "fake", "prompt": "x", "suffix": "y"}).encode(), 400, "suffix"),
    ("/api/generate", json.dumps({"model": "fake", "prompt": "x", "template": "{{ .Prompt }}"}).encode(), 400, "template"),
    ("/api/generate", json.dumps({"model": "fake", "prompt": "x", "context": [1, 999]}).encode(), 400, "context"),
    ("/api/generate", json.dumps({"model": "fake", "prompt": 5}).encode(), 400, "prompt"),
    ("/api/show", json.dumps({"model": "nope"}).encode(), 404, "not found"),
    ("/api/show", json.dumps({}).encode(), 400, "model is required"),
    ("/api/show", json.dumps({"name": ""}).encode(), 400, "name"),
    ("/api/embed", json.dumps({"model": "nope", "input": "x"}).encode(), 404, "not found"),
    ("/api/embed", json.dumps({"model": "fake", "input": ["x", ""]}).encode(), 400, "empty strings"),
    ("/api/embed", json.dumps({"model": "fake", "input": 5}).encode(), 400, "input"),
    ("/api/embed", json.dumps({"model": "fake", "input": "x", "dimensions": 8}).encode(), 400, "dimensions"),
    ("/api/embeddings", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "not found"),
]


@pytest.mark.parametrize(("path", "raw", "status", "words"), BAD_REQUESTS)
def test_bad_requests_get_ollama_errors_and_the_server_keeps_serving(
    client: TestClient, path: str, raw: bytes, status: int, words: str
) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and words in body["error"] and "Traceback" not in body["error"]
    assert client.post("/api/chat", json=chat(stream=False, options={"num_predict": 2})).json()["message"]["content"] == "He"


def test_failure_mid_stream_is_an_error_line(client: TestClient, fake: FakeEngine) -> None:
    fake.fail_after = 2
    lines = ndjson(client.post("/api/chat", json=chat()).text)
    assert [line.get("message", {}).get("content") for line in lines[:-1]] == ["H", "e"]
    assert lines[-1] == {"error": "generation failed: boom"}
    r = client.post("/api/generate", json={"model": "fake", "prompt": "x", "stream": False})
    assert r.status_code == 500 and r.json() == {"error": "generation failed: boom"}


def test_overloaded_and_not_ready(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = Overloaded("64 requests are waiting; retry later")
    r = client.post("/api/chat", json=chat())
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and "waiting" in r.json()["error"]
    fake.raise_on_submit = EngineStopped("stopping")
    assert client.post("/api/chat", json=chat()).status_code == 503
    fake.raise_on_submit = None
    fake.state = "loading"
    for r in (client.post("/api/chat", json=chat()), client.get("/api/tags")):
        assert r.status_code == 503 and "loading" in r.json()["error"]


def test_a_bug_is_a_bare_500(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = ZeroDivisionError("secret internals")
    r = client.post("/api/generate", json={"model": "fake", "prompt": "x"})
    assert r.status_code == 500 and r.json() == {"error": "internal server error"}


# -- the official client, over a real socket --------------------------------------------------------


def test_the_official_client_reads_our_responses(fake: FakeEngine) -> None:
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        api = ollama.Client(host=url, timeout=10)
        reply = api.chat(model="fake", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 5})
        assert reply.message.content == "Hello" and reply.done and reply.done_reason == "length"
        assert reply.eval_count == 5 and reply.prompt_eval_count and reply.total_duration
        parts = list(api.chat(model="fake", messages=[{"role": "user", "content": "hi"}], stream=True,
                              options={"num_predict": 5, "stop": ["l"]}))
        assert "".join(p.message.content or "" for p in parts) == "He" and parts[-1].done_reason == "stop"
        generated = api.generate(model="fake", prompt="x", options={"num_predict": 3})
        assert generated.response == "Hel" and generated.context
        assert [m.model for m in api.list().models] == ["fake"]
        assert api.show("fake").modelinfo["fake.context_length"] == 64  # type: ignore[index]
        assert [m.model for m in api.ps().models] == ["fake"]
        with pytest.raises(ollama.ResponseError) as info:
            api.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 404 and "not found" in info.value.error
        fake.fail_after = 1
        with pytest.raises(ollama.ResponseError, match="boom"):
            list(api.chat(model="fake", messages=[{"role": "user", "content": "hi"}], stream=True))


def test_a_client_leaving_a_stream_cancels_its_request(fake: FakeEngine) -> None:
    fake.endless = True
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        with httpx.stream("POST", f"{url}/api/chat", json=chat()) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines))["done"] is False
        assert wait_until(lambda: fake.handles[0].cancelled), "the request kept generating"


# -- the real engine on a tiny random model ---------------------------------------------------------


def test_tiny_chat_streamed_equals_whole(tiny_app: TestClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the wine"}],
            "options": {"temperature": 0, "num_predict": 12}}
    whole = tiny_app.post("/api/chat", json={**body, "stream": False}).json()
    lines = ndjson(tiny_app.post("/api/chat", json=body).text)
    assert "".join(line["message"]["content"] for line in lines) == whole["message"]["content"]
    assert lines[-1]["eval_count"] == whole["eval_count"] and lines[-1]["done_reason"] == whole["done_reason"]
    assert whole["prompt_eval_count"] == lines[-1]["prompt_eval_count"] > 5
    assert whole["prompt_eval_duration"] > 0 and whole["eval_duration"] >= 0
    tags = tiny_app.get("/api/tags").json()["models"]
    assert tags[0]["details"]["quantization_level"] == "F32" and tags[0]["size"] > 100_000
