"""The Anthropic Messages API: wire shapes, stop reasons, validation and errors over a scripted
engine (fast), the official ``anthropic`` client over a real socket, then the real engine on a tiny
random GGUF model."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, FakeTokenizer, ThreadedServer, make_ctx, wait_until

from mlxr_core.config.schema import SamplingConfig, ServerConfig
from mlxr_core.errors import EngineStopped, Overloaded
from mlxr_core.http.server import build_app

MESSAGES = "/v1/messages"


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake: FakeEngine):
    with TestClient(build_app(make_ctx(fake))) as test_client:
        yield test_client


def message(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 16, "messages": [{"role": "user", "content": content}], **extra}


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event; the name must match the data's type."""
    assert text.endswith("\n\n")
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def prompt_of(text: str) -> list[int]:
    return FakeTokenizer().encode(text, add_special_tokens=False)


# -- shapes ----------------------------------------------------------------------------------------


def test_message(client: TestClient, fake: FakeEngine) -> None:
    r = client.post(MESSAGES, json=message(max_tokens=5))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "fake" and body["content"] == [{"type": "text", "text": "Hello"}]
    assert body["stop_reason"] == "max_tokens" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": len(fake.requests[0].prompt_ids), "output_tokens": 5,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
    assert fake.requests[0].prompt_ids == prompt_of("<user>hi<assistant>")


def test_stop_reasons(client: TestClient) -> None:
    ended = client.post(MESSAGES, json=message(max_tokens=40)).json()
    assert ended["content"][0]["text"] == FakeEngine.REPLY and ended["stop_reason"] == "end_turn"
    # (The scripted engine matches single characters; the tiny-model test below covers longer ones.)
    stopped = client.post(MESSAGES, json=message(stop_sequences=["zz", "w"])).json()
    assert stopped["content"][0]["text"] == "Hello, " and stopped["stop_reason"] == "stop_sequence"
    assert stopped["stop_sequence"] == "w"


def test_system_prompts_merged_turns_and_prefill(client: TestClient, fake: FakeEngine) -> None:
    client.post(MESSAGES, json=message(system="be brief"))
    assert fake.requests[-1].prompt_ids == prompt_of("<system>be brief<user>hi<assistant>")
    blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]
    client.post(MESSAGES, json=message(content=blocks, system=blocks))
    assert fake.requests[-1].prompt_ids == prompt_of("<system>a\n\nb<user>a\n\nb<assistant>")
    turns = [{"role": "user", "content": "x"}, {"role": "user", "content": "y"},
             {"role": "assistant", "content": "The answer is"}]
    body = client.post(MESSAGES, json={"model": "fake", "max_tokens": 3, "messages": turns}).json()
    # The final assistant turn is continued, not closed, and the reply holds only the new text.
    assert fake.requests[-1].prompt_ids == prompt_of("<user>x\n\ny<assistant>The answer is")
    assert body["content"][0]["text"] == "Hel"


def test_sampling_fields_reach_the_engine(fake: FakeEngine) -> None:
    defaults = SamplingConfig(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05)
    with TestClient(build_app(make_ctx(fake, sampling=defaults))) as client:
        client.post(MESSAGES, json=message())
        client.post(MESSAGES, json=message(temperature=0, top_p=0.5, top_k=3, metadata={"user_id": "u"},
                                           service_tier="auto", thinking={"type": "disabled"}))
    first, second = (r.params for r in fake.requests)
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.7, 0.9, 40, 0.05)
    assert (second.temperature, second.top_p, second.top_k) == (0.0, 0.5, 3)


def test_max_tokens_is_an_upper_bound(fake: FakeEngine) -> None:
    with TestClient(build_app(make_ctx(fake, server=ServerConfig(max_tokens_cap=7)))) as client:
        assert client.post(MESSAGES, json=message(max_tokens=4096)).json()["stop_reason"] == "max_tokens"
        client.post(MESSAGES, json=message(max_tokens=3))
    assert [r.params.max_tokens for r in fake.requests] == [7, 3]
    uncapped = FakeEngine()
    with TestClient(build_app(make_ctx(uncapped))) as client:
        client.post(MESSAGES, json=message(max_tokens=4096))
    assert uncapped.requests[0].params.max_tokens == 64 - len(uncapped.requests[0].prompt_ids)


def test_stream_events(client: TestClient, fake: FakeEngine) -> None:
    r = client.post(MESSAGES, json=message(stream=True, stop_sequences=[","]))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert start["usage"] == {"input_tokens": len(fake.requests[0].prompt_ids), "output_tokens": 0,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta") == "Hello"
    assert all(data["delta"]["type"] == "text_delta" for name, data in events if name == "content_block_delta")
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": ","}
    assert events[-2][1]["usage"] == {"output_tokens": 6, "input_tokens": len(fake.requests[0].prompt_ids),
                                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip


def test_count_tokens(client: TestClient, fake: FakeEngine) -> None:
    r = client.post(f"{MESSAGES}/count_tokens", json={"model": "fake", "system": "s", "messages": [{"role": "user", "content": "hi"}]})
    assert r.json() == {"input_tokens": len(prompt_of("<system>s<user>hi<assistant>"))}
    assert fake.requests == []


# -- bad input -------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (raw body, status, error type, words the message must contain)
    (b'{"model": "fake", "max_tokens": 5, "messages": [', 400, "invalid_request_error", "not valid JSON"),
    (b"", 400, "invalid_request_error", "empty"),
    (json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}]}).encode(), 400, "invalid_request_error", "max_tokens"),
    (json.dumps(message(max_tokens=0)).encode(), 400, "invalid_request_error", "max_tokens"),
    (json.dumps(message(max_tokens="5")).encode(), 400, "invalid_request_error", "max_tokens"),
    (json.dumps(message(temperature=1.5)).encode(), 400, "invalid_request_error", "temperature"),
    (json.dumps(message(top_k=-1)).encode(), 400, "invalid_request_error", "top_k"),
    (json.dumps(message(model="claude-opus")).encode(), 404, "not_found_error", "claude-opus"),
    (json.dumps(message(tools=[{"name": "web", "type": "web_search_20250305"}])).encode(), 400, "invalid_request_error", "tools[0].type"),
    (json.dumps(message(tools=[{"name": "f"}], tool_choice={"type": "tool"})).encode(), 400, "invalid_request_error", "tool_choice.name"),
    (json.dumps(message(tools=[{"name": "f"}], tool_choice={"type": "tool", "name": "g"})).encode(), 400, "invalid_request_error", "tool_choice"),
    (json.dumps(message(tool_choice={"type": "any"})).encode(), 400, "invalid_request_error", "tool_choice"),
    (json.dumps(message(thinking={"type": "sometimes"})).encode(), 400, "invalid_request_error", "thinking.type"),
    (json.dumps(message(content=[{"type": "image", "source": {}}])).encode(), 400, "invalid_request_error", "messages[0].content[0]"),
    (json.dumps(message(stop_sequences=[""])).encode(), 400, "invalid_request_error", "stop_sequences"),
    (json.dumps(message(stream=1)).encode(), 400, "invalid_request_error", "stream"),
    (json.dumps({"model": "fake", "max_tokens": 5, "messages": []}).encode(), 400, "invalid_request_error", "messages"),
    (json.dumps({"model": "fake", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}).encode(),
     400, "invalid_request_error", "messages[0].role"),
    (json.dumps(message(content="x" * 100)).encode(), 400, "invalid_request_error", "context length"),
]


@pytest.mark.parametrize(("raw", "status", "kind", "words"), BAD_REQUESTS)
def test_bad_requests_get_anthropic_errors_and_the_server_keeps_serving(
    client: TestClient, raw: bytes, status: int, kind: str, words: str
) -> None:
    r = client.post(MESSAGES, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and words in body["error"]["message"], body
    assert client.post(MESSAGES, json=message(max_tokens=2)).json()["content"][0]["text"] == "He"


def test_failure_mid_stream_is_an_error_event(client: TestClient, fake: FakeEngine) -> None:
    fake.fail_after = 2
    events = sse(client.post(MESSAGES, json=message(stream=True)).text)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}})
    r = client.post(MESSAGES, json=message())
    assert r.status_code == 500 and r.json()["error"] == {"type": "api_error", "message": "generation failed: boom"}


def test_overloaded_and_not_ready(client: TestClient, fake: FakeEngine) -> None:
    fake.raise_on_submit = Overloaded("64 requests are waiting; retry later")
    r = client.post(MESSAGES, json=message())
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    fake.raise_on_submit = EngineStopped("stopping")
    r = client.post(MESSAGES, json=message())
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    fake.raise_on_submit = ZeroDivisionError("secret internals")
    r = client.post(MESSAGES, json=message())
    assert r.status_code == 500 and r.json()["error"] == {"type": "api_error", "message": "internal server error"}


# -- the official client, over a real socket --------------------------------------------------------


def test_the_official_client_reads_our_responses(fake: FakeEngine) -> None:
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        api = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)
        turn: Any = [{"role": "user", "content": "hi"}]
        reply = api.messages.create(model="fake", max_tokens=5, messages=turn, system="s")
        assert reply.content[0].text == "Hello" and reply.stop_reason == "max_tokens"  # type: ignore[union-attr]
        assert reply.usage.output_tokens == 5
        with api.messages.stream(model="fake", max_tokens=30, messages=turn, stop_sequences=["!"]) as stream:
            assert "".join(stream.text_stream) == "Hello, world"
            final = stream.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "!"
        assert api.messages.count_tokens(model="fake", messages=turn).input_tokens == len(prompt_of("<user>hi<assistant>"))
        with pytest.raises(anthropic.NotFoundError):
            api.messages.create(model="nope", max_tokens=5, messages=turn)
        with pytest.raises(anthropic.BadRequestError, match="temperature"):
            api.messages.create(model="fake", max_tokens=5, messages=turn, extra_body={"temperature": 3})
        fake.fail_after = 1
        with pytest.raises(anthropic.APIStatusError, match="boom"):
            list(api.messages.create(model="fake", max_tokens=5, messages=turn, stream=True))


def test_a_client_leaving_a_stream_cancels_its_request(fake: FakeEngine) -> None:
    fake.endless = True
    with ThreadedServer(build_app(make_ctx(fake))) as url:
        with httpx.stream("POST", f"{url}{MESSAGES}", json=message(stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines) == "event: message_start"
        assert wait_until(lambda: fake.handles[0].cancelled), "the request kept generating"


# -- the real engine on a tiny random model ---------------------------------------------------------


def test_tiny_stream_equals_whole_and_stop_sequences(tiny_app: TestClient) -> None:
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "the wine"}]}
    whole = tiny_app.post(MESSAGES, json=body).json()
    text = whole["content"][0]["text"]
    events = sse(tiny_app.post(MESSAGES, json={**body, "stream": True}).text)
    assert "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta") == text
    assert events[-2][1]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert whole["stop_reason"] == "max_tokens" and len(text) > 4, "the tiny model must say something"
    stop = text[2:4]
    cut = tiny_app.post(MESSAGES, json={**body, "stop_sequences": ["\x00never", stop]}).json()
    assert cut["content"][0]["text"] == text[: text.index(stop)]
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", stop)
