"""Background responses through the official ``openai`` client over a real socket (a scripted
engine): ``background: true``, polling, streaming again from an event number, cancel; and an
operator's cancel of any running request by its id."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from scripted import FakeEngine, ThreadedServer, make_ctx

from mlxr_core.config.schema import ResponsesStoreConfig, ServerConfig
from mlxr_core.http.server import build_app


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def url(fake: FakeEngine, tmp_path: Path) -> Iterator[str]:
    server = ServerConfig(responses_store=ResponsesStoreConfig(path=str(tmp_path / "responses.sqlite3")))
    with ThreadedServer(build_app(make_ctx(fake, server=server))) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def wait_for(client: openai.OpenAI, response_id: str, statuses: tuple[str, ...]) -> openai.types.responses.Response:
    deadline = time.monotonic() + 20
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.02)


def test_a_background_response_is_polled_to_its_end(client: openai.OpenAI, fake: FakeEngine) -> None:
    fake.token_delay_s = 0.01
    started = client.responses.create(model="fake", input="hi", background=True)
    assert started.background and started.status in ("queued", "in_progress")
    done = wait_for(client, started.id, ("completed", "incomplete"))
    assert done.usage is not None and done.output_text == FakeEngine.REPLY[: done.usage.output_tokens]
    # A follow-up continues it like any stored response.
    client.responses.create(model="fake", input="more", previous_response_id=started.id)
    assert done.output_text in bytes(fake.requests[-1].prompt_ids).decode()


def test_streaming_again_from_an_event_number(client: openai.OpenAI, fake: FakeEngine) -> None:
    fake.token_delay_s = 0.005
    events = list(client.responses.create(model="fake", input="hi", background=True, stream=True))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events))) and events[0].type == "response.queued"
    assert events[-1].type in ("response.completed", "response.incomplete")
    response_id = events[-1].response.id
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=4))
    assert [event.sequence_number for event in again] == numbers[5:]
    assert [event.model_dump() for event in again] == [event.model_dump() for event in events[5:]]


def test_cancel_ends_a_running_background_response(client: openai.OpenAI, fake: FakeEngine) -> None:
    fake.endless = True
    started = client.responses.create(model="fake", input="hi", background=True)
    wait_for(client, started.id, ("in_progress",))
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and fake.handles[-1].cancelled
    assert client.responses.retrieve(started.id).status == "cancelled"
    assert client.responses.cancel(started.id).status == "cancelled"  # again: as it is


def test_background_needs_store_and_only_background_responses_cancel(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="fake", input="hi", background=True, store=False)
    assert error.value.body["param"] == "background"  # type: ignore[index]
    plain = client.responses.create(model="fake", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve(plain.id, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")


def test_an_operator_cancels_any_running_request_by_id(url: str, fake: FakeEngine) -> None:
    fake.endless = True
    with httpx.Client(base_url=url, timeout=30) as http, http.stream(
        "POST", "/v1/chat/completions", headers={"x-request-id": "job-42"},
        json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as stream:  # fmt: skip
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        answer = http.post("/v1/requests/job-42/cancel", json={})
        assert answer.status_code == 200 and answer.json() == {"id": "job-42", "cancelled": True, "object": "request"}
        assert fake.handles[-1].cancelled
        rest = list(lines)
    assert any("cancelled by an operator" in line for line in rest), rest  # the stream ends saying why
    missing = httpx.post(f"{url}/v1/requests/job-42/cancel", json={})
    assert missing.status_code == 404 and "error" in missing.json()


def test_an_operator_cancel_of_a_background_response_leaves_it_cancelled(url: str, client: openai.OpenAI, fake: FakeEngine) -> None:
    fake.endless = True
    started = client.responses.create(model="fake", input="hi", background=True)
    wait_for(client, started.id, ("in_progress",))
    assert httpx.post(f"{url}/v1/requests/{started.id}/cancel", json={}).status_code == 200
    assert wait_for(client, started.id, ("cancelled", "failed")).status == "cancelled" and fake.handles[-1].cancelled


def test_only_the_key_that_sent_a_request_cancels_it_by_id(fake: FakeEngine, tmp_path: Path) -> None:
    """With API keys, a request id names the sender's requests alone: another key's cancel of it is
    a 404 and leaves it running (ids are the client's own x-request-id, often guessable); every
    choice of an n > 1 request is cancelled."""
    server = ServerConfig(api_keys=["key-a", "key-b"], responses_store=ResponsesStoreConfig(path=str(tmp_path / "r.sqlite3")))
    fake.endless = True
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    with ThreadedServer(build_app(make_ctx(fake, server=server))) as url, httpx.Client(base_url=url, timeout=30) as http:
        a, b = ({"authorization": f"Bearer {key}"} for key in ("key-a", "key-b"))
        with http.stream("POST", "/v1/chat/completions", headers={**a, "x-request-id": "job-7"}, json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            other = http.post("/v1/requests/job-7/cancel", headers=b, json={})
            assert other.status_code == 404 and "error" in other.json()
            assert not any(handle.cancelled for handle in fake.handles[-2:])
            own = http.post("/v1/requests/job-7/cancel", headers=a, json={})
            assert own.status_code == 200 and own.json()["cancelled"] is True
            assert all(handle.cancelled for handle in fake.handles[-2:])
            list(lines)


def test_finished_runs_are_kept_within_a_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest finished runs' events go first once those kept pass KEPT_BYTES (or KEPT runs)."""
    import asyncio
    import types

    import mlxr_plugins.apis.openai.background as background

    monkeypatch.setattr(background, "KEPT_BYTES", 2500)

    async def main() -> list[str]:
        runs = background.BackgroundRuns()

        async def events(run: background.Run):  # type: ignore[no-untyped-def]
            for i in range(10):
                run.record(i, b"x" * 100)
                yield None

        for i in range(5):
            response = types.SimpleNamespace(id=f"resp_{i}")  # all a run's bookkeeping reads of it
            run = background.Run(response, None, None)  # type: ignore[arg-type]
            runs.start(run, events(run))
            assert run.task is not None
            await run.task
        return [i for i in (f"resp_{n}" for n in range(5)) if runs.get(i, None) is not None]

    assert asyncio.run(main()) == ["resp_3", "resp_4"]  # 1,000 bytes each: two fit in 2,500
