"""The Responses API through the official ``openai`` client on a live server: whole and streamed
(the client checks the event sequence itself), instructions, previous_response_id, the store's
retrieve / input_items / delete, incomplete replies and errors over a scripted engine; then a
function-tool round trip and a JSON schema on the real engine with a tiny random model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from scripted import FakeEngine, ThreadedServer, live_server, make_ctx

from mlxr_core.config.schema import Config, ModelConfig, ResponsesStoreConfig, ServerConfig
from mlxr_core.http.server import build_app

REPLY = FakeEngine.REPLY


def store_config(tmp_path: Path) -> ServerConfig:
    return ServerConfig(responses_store=ResponsesStoreConfig(path=str(tmp_path / "responses.sqlite3")))


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_length=512)


@pytest.fixture
def client(fake: FakeEngine, tmp_path: Path) -> Iterator[openai.OpenAI]:
    with ThreadedServer(build_app(make_ctx(fake, server=store_config(tmp_path)))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_of(fake: FakeEngine, index: int = -1) -> str:
    return bytes(fake.requests[index].prompt_ids).decode()


def test_a_text_input_gets_a_message(client: openai.OpenAI, fake: FakeEngine) -> None:
    response = client.responses.create(model="fake", max_output_tokens=64, input="hi", instructions="Be brief.")
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == REPLY
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert prompt_of(fake) == "<system>Be brief.<user>hi<assistant>"
    usage = response.usage
    assert usage is not None and usage.input_tokens == len(fake.requests[0].prompt_ids)
    assert usage.output_tokens == len(REPLY) and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, fake: FakeEngine) -> None:
    first = client.responses.create(model="fake", max_output_tokens=64, input="hi", instructions="Be brief.")
    second = client.responses.create(model="fake", max_output_tokens=64, input=[{"role": "user", "content": "more"}], previous_response_id=first.id)
    # the earlier turns, the reply included, come back; its instructions do not (as OpenAI's API)
    assert prompt_of(fake) == f"<user>hi<assistant>{REPLY}<user>more<assistant>"
    assert second.previous_response_id == first.id
    third = client.responses.create(model="fake", max_output_tokens=64, input="again", previous_response_id=second.id, instructions="New.")
    assert prompt_of(fake) == f"<system>New.<user>hi<assistant>{REPLY}<user>more<assistant>{REPLY}<user>again<assistant>"
    assert client.responses.retrieve(third.id).output_text == REPLY
    items = client.responses.input_items.list(second.id)
    assert [(item.type, item.role) for item in items.data] == [("message", "user")]  # type: ignore[union-attr]


def test_stored_responses_are_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    made = client.responses.create(model="fake", max_output_tokens=64, input=[
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])  # fmt: skip
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == REPLY and got.usage == made.usage
    items = client.responses.input_items.list(made.id).data
    assert [item.role for item in items] == ["user", "developer"]  # type: ignore[union-attr]  # newest first
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unstored = client.responses.create(model="fake", max_output_tokens=64, input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="fake", max_output_tokens=64, input="hi", previous_response_id="resp_nope")
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="fake", max_output_tokens=64, input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY  # type: ignore[union-attr]
    assert final.output_text == REPLY and final.status == "completed"
    assert client.responses.retrieve(final.id).output_text == REPLY
    # the raw stream, as a client without the helper reads it
    raw = client.responses.create(model="fake", input="hi", stream=True, max_output_tokens=3)
    last = list(raw)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model="fake", input="hi", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == REPLY[:5]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "input_image_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        # the scripted model takes no images
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": "hi", "temperature": 3}, "temperature"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(client: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    if "tools" in body:
        body["tools"][0].setdefault("name", "x")
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/responses", body={"model": "fake", **body}, cast_to=object)
    assert error.value.body["param"] == param  # type: ignore[index]


def test_a_stored_response_belongs_to_the_key_that_made_it(fake: FakeEngine, tmp_path: Path) -> None:
    server = ServerConfig(api_keys=["key-alice", "key-bob"], responses_store=store_config(tmp_path).responses_store)
    with ThreadedServer(build_app(make_ctx(fake, server=server))) as url:
        alice, bob = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
                      for key in ("key-alice", "key-bob"))  # fmt: skip
        made = alice.responses.create(model="fake", max_output_tokens=64, input="the code is 4242")
        with alice.responses.stream(model="fake", max_output_tokens=64, input="streamed") as stream:
            list(stream)
            streamed = stream.get_final_response()
        for rid in (made.id, streamed.id):
            # to another key each is a 404 in OpenAI's shape, exactly as an id never stored
            for absent in (rid, "resp_nope"):
                with pytest.raises(openai.NotFoundError) as missing:
                    bob.responses.retrieve(absent)
                assert missing.value.body == {  # type: ignore[comparison-overlap]
                    "message": f"no stored response with id {absent!r}", "type": "invalid_request_error",
                    "param": None, "code": None}  # fmt: skip
            with pytest.raises(openai.NotFoundError):
                bob.responses.input_items.list(rid)
            with pytest.raises(openai.NotFoundError) as missing:
                bob.responses.create(model="fake", max_output_tokens=64, input="and?", previous_response_id=rid)
            assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(rid)
            # still there for its owner, who can read, continue and delete it
            assert alice.responses.retrieve(rid).id == rid
            assert alice.responses.input_items.list(rid).data
        assert "4242" not in prompt_of(fake)  # bob's turns never rendered alice's conversation
        follow = alice.responses.create(model="fake", max_output_tokens=64, input="and?", previous_response_id=made.id)
        assert prompt_of(fake) == f"<user>the code is 4242<assistant>{REPLY}<user>and?<assistant>"
        mine = bob.responses.create(model="fake", max_output_tokens=64, input="mine")
        assert bob.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(mine.id)
        alice.responses.delete(follow.id)
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(follow.id)
    # the store keeps a hash of the key, never the key
    raw = (tmp_path / "responses.sqlite3").read_bytes() + b"".join(
        path.read_bytes() for path in tmp_path.glob("responses.sqlite3-*"))  # fmt: skip
    assert b"key-alice" not in raw and b"key-bob" not in raw


# -- on the real engine --------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=2048)],
        apis=["openai"], server=store_config(tmp_path_factory.mktemp("store")),
    )  # fmt: skip
    with live_server(config) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_function_tool_round_trip(tiny: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}]
    forced: Any = {"type": "function", "name": "get_weather"}
    called = tiny.responses.create(model="tiny", input="Weather in Paris?", tools=tools, tool_choice=forced,
                                   max_output_tokens=200, temperature=0)  # fmt: skip
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the result goes back after the stored conversation; the answer is plain text
    answer = tiny.responses.create(
        model="tiny", previous_response_id=called.id, tools=tools, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete") and all(item.type != "function_call" for item in answer.output)
    # the same round trip given whole, as a client that keeps its own history sends it
    whole = tiny.responses.create(model="tiny", tools=tools, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])  # fmt: skip
    assert whole.output_text == answer.output_text
    # streamed: the call's arguments arrive as deltas, and the final response holds the call
    with tiny.responses.stream(model="tiny", input="Weather in Paris?", tools=tools, tool_choice=forced,
                               max_output_tokens=200, temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    streamed = [item for item in final.output if item.type == "function_call"]
    assert deltas == streamed[0].arguments == call.arguments  # type: ignore[union-attr]


def test_a_json_schema_text_format_is_enforced(tiny: openai.OpenAI) -> None:
    response = tiny.responses.create(
        model="tiny", input="A city?", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), WEATHER)


def test_a_streamed_response_is_an_event_stream(client: openai.OpenAI) -> None:
    import httpx

    body = {"model": "fake", "input": "hi", "stream": True, "max_output_tokens": 3}
    reply = httpx.post(f"{client.base_url}responses", json=body, timeout=30)
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text.startswith("event: response.created\ndata: ")
