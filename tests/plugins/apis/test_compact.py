"""``POST /v1/responses/compact`` through the official ``openai`` client over a real socket (a
scripted engine): the user messages kept, one compaction item summarizing the rest, and
Codex-shaped round trips after it (the items sent back as input, or previous_response_id)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from scripted import FakeEngine, ThreadedServer, make_ctx

from mlxr_core.config.schema import ResponsesStoreConfig, ServerConfig
from mlxr_core.http.server import build_app
from mlxr_plugins.apis.openai.compact import COMPACT_PROMPT, SUMMARY_HEADING, decode_summary


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_length=4096)


@pytest.fixture
def client(fake: FakeEngine, tmp_path: Path) -> Iterator[openai.OpenAI]:
    server = ServerConfig(responses_store=ResponsesStoreConfig(path=str(tmp_path / "responses.sqlite3")))
    with ThreadedServer(build_app(make_ctx(fake, server=server))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_text(fake: FakeEngine) -> str:
    return bytes(fake.requests[-1].prompt_ids).decode()


def test_a_conversation_compacts_to_its_user_messages_and_a_summary(client: openai.OpenAI, fake: FakeEngine) -> None:
    first = client.responses.create(model="fake", input="Fix the bug in parser.py")
    second = client.responses.create(model="fake", input="Now add a test", previous_response_id=first.id)
    compacted = client.responses.compact(model="fake", previous_response_id=second.id)
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    asked = prompt_text(fake)
    assert "Fix the bug in parser.py" in asked and "Now add a test" in asked and COMPACT_PROMPT in asked
    *users, item = compacted.output
    assert [u.model_dump()["content"][0]["text"] for u in users] == ["Fix the bug in parser.py", "Now add a test"]
    assert item.type == "compaction" and item.id
    summary = decode_summary(item.encrypted_content, "x")
    assert summary and FakeEngine.REPLY.startswith(summary)
    assert compacted.usage.input_tokens == len(fake.requests[-1].prompt_ids) and compacted.usage.output_tokens > 0

    # Codex's round trip: the compacted items as input, then the next turn.
    items = [entry.model_dump(exclude_none=True) for entry in compacted.output]
    client.responses.create(model="fake", input=[*items, {"role": "user", "content": "Run the tests"}])
    follow = prompt_text(fake)
    assert SUMMARY_HEADING + summary in follow and follow.index("Now add a test") < follow.index("Run the tests")
    # Or by id: the compaction is stored like a response.
    client.responses.create(model="fake", input="Run the tests", previous_response_id=compacted.id)
    assert prompt_text(fake) == follow
    assert client.responses.retrieve(compacted.id).id == compacted.id


def test_bad_compactions_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.compact(model="fake")
    assert error.value.body["param"] == "input"  # type: ignore[index]
    forged = [{"type": "compaction", "encrypted_content": "gAAAA-from-elsewhere"}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="fake", input=forged)  # type: ignore[arg-type]
    assert error.value.body["param"] == "input[0].encrypted_content"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.compact(model="fake", previous_response_id="resp_missing")
