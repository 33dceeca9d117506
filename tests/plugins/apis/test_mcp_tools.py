"""MCP tools run by the server, through the official ``openai`` client over a real socket: fake
MCP servers (the ``mcp`` SDK's) over stdio and streamable HTTP, one that hangs, one that crashes,
one that dies at start; a scripted model whose turns call their tools."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from scripted import ThreadedServer, make_ctx
from scripted_mcp import ScriptedTurns, call, prompt_of, stdio

from mlxr_core.config.schema import McpConfig, McpServerConfig, ResponsesStoreConfig, ServerConfig
from mlxr_core.http.server import build_app

pytest.importorskip("mcp")
pytestmark = pytest.mark.slow  # starts MCP server processes


@pytest.fixture
def fake() -> ScriptedTurns:
    return ScriptedTurns()


@pytest.fixture
def client(fake: ScriptedTurns, mcp_http_url: str, tmp_path: Path) -> Iterator[openai.OpenAI]:
    mcp = McpConfig(servers=[
        stdio("files", "ok", allowed_tools=["add"], timeout_s=60), McpServerConfig(name="web", url=mcp_http_url, timeout_s=60),
        stdio("stuck", "hang", timeout_s=25), stdio("broken", "crash", timeout_s=60), stdio("dead", "dead"),
    ], max_turns=3)  # fmt: skip
    server = ServerConfig(responses_store=ResponsesStoreConfig(path=str(tmp_path / "responses.sqlite3")))
    with ThreadedServer(build_app(make_ctx(fake, server=server, mcp=mcp))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def tools(*labels: str, approval: Any = "never") -> list[Any]:
    return [{"type": "mcp", "server_label": label, "require_approval": approval} for label in labels]


def test_stdio_and_http_tools_run_between_turns(client: openai.OpenAI, fake: ScriptedTurns) -> None:
    fake.replies = [call("add", a=2, b=3), call("shout", text="hi"), "Five, and HI."]
    offered = [*tools("files"), {**tools("web")[0], "allowed_tools": ["shout"]}]  # both serve add: one each
    response = client.responses.create(model="fake", input="go", tools=offered, max_output_tokens=500)  # type: ignore[arg-type]
    kinds = [item.type for item in response.output]
    assert kinds == ["mcp_list_tools", "mcp_list_tools", "mcp_call", "mcp_call", "message"]
    files, web = response.output[0], response.output[1]
    assert [t.name for t in files.tools] == ["add"]  # the config's allowed_tools  # type: ignore[union-attr]
    assert [t.name for t in web.tools] == ["shout"]  # the request's  # type: ignore[union-attr]
    added, shouted = response.output[2], response.output[3]
    assert (added.server_label, added.name, added.output, added.error) == ("files", "add", "5", None)  # type: ignore[union-attr]
    assert (shouted.server_label, shouted.output) == ("web", "HI")  # type: ignore[union-attr]
    assert response.output_text == "Five, and HI." and response.status == "completed"
    assert "5" in prompt_of(fake, -2) and "HI" in prompt_of(fake, -1)  # each result fed back


def test_a_hanging_or_crashing_server_is_an_error_item(client: openai.OpenAI, fake: ScriptedTurns) -> None:
    for label, said in (("stuck", "did not answer within 25 s"), ("broken", "")):
        fake.replies = [call("add", a=1, b=1), "Sorry."]
        response = client.responses.create(model="fake", input="go", tools=tools(label), max_output_tokens=500)  # type: ignore[arg-type]
        assert any(item.type == "mcp_call" for item in response.output), response.output
        called = next(item for item in response.output if item.type == "mcp_call")
        assert called.error and said in called.error and called.output is None  # type: ignore[union-attr]
        assert "Error:" in prompt_of(fake) and response.output_text == "Sorry."
    fake.replies = ["Nothing to use."]
    response = client.responses.create(model="fake", input="go", tools=tools("dead"), max_output_tokens=500)  # type: ignore[arg-type]
    assert response.output[0].type == "mcp_list_tools" and response.output[0].error  # type: ignore[union-attr]
    assert response.output_text == "Nothing to use."


def test_approval_requests_and_responses(client: openai.OpenAI, fake: ScriptedTurns) -> None:
    fake.replies = [call("add", a=20, b=22)]
    asked = client.responses.create(model="fake", input="go", tools=tools("files", approval="always"), max_output_tokens=500)  # type: ignore[arg-type]
    request = asked.output[-1]
    assert request.type == "mcp_approval_request" and request.name == "add"  # type: ignore[union-attr]
    fake.replies = ["It is 42."]
    answered = client.responses.create(
        model="fake", previous_response_id=asked.id, tools=tools("files", approval="always"), max_output_tokens=500,  # type: ignore[arg-type]
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}],  # type: ignore[list-item]
    )
    called = answered.output[0]  # the approved call runs before the turn
    assert called.type == "mcp_call" and called.output == "42" and called.approval_request_id == request.id  # type: ignore[union-attr]
    assert answered.output_text == "It is 42." and "42" in prompt_of(fake)


def test_the_loop_is_bounded_and_bad_tools_are_refused(client: openai.OpenAI, fake: ScriptedTurns) -> None:
    fake.replies = [call("add", a=1, b=2)]
    response = client.responses.create(model="fake", input="go", tools=tools("files"), max_output_tokens=500)  # type: ignore[arg-type]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_turns"  # type: ignore[union-attr]
    assert [item.type for item in response.output].count("mcp_call") == 3
    for spec, param in (({"type": "mcp", "server_label": "nowhere"}, "tools[0].server_label"),
                        ({"type": "mcp", "server_label": "files", "server_url": "http://x"}, "tools[0].server_url")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model="fake", input="go", tools=[spec])  # type: ignore[list-item]
        assert error.value.body["param"] == param  # type: ignore[index]


def test_a_tool_choice_naming_an_mcp_tool_forces_the_first_turn_only(client: openai.OpenAI, fake: ScriptedTurns) -> None:
    fake.replies = [call("add", a=2, b=3), "Five."]
    choice: Any = {"type": "mcp", "server_label": "files", "name": "add"}
    response = client.responses.create(model="fake", input="go", tools=tools("files"), tool_choice=choice, max_output_tokens=500)  # type: ignore[arg-type]
    assert [item.type for item in response.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert response.status == "completed" and response.output_text == "Five."
    assert response.tool_choice.type == "mcp" and response.tool_choice.name == "add"  # type: ignore[union-attr]
    first, second = fake.requests[-2:]
    assert first.params.constraint is not None and second.params.constraint is None  # the call forced once
    for wrong, param in (({**choice, "server_label": "web"}, "tool_choice.server_label"),
                         ({**choice, "name": "shout"}, "tool_choice.name")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model="fake", input="go", tools=tools("files"), tool_choice=wrong)  # type: ignore[arg-type]
        assert error.value.body["param"] == param  # type: ignore[index]
    # A server that failed to list its tools cannot have its call forced: the model answers without it.
    fake.replies = ["No tools."]
    dead = client.responses.create(model="fake", input="go", tools=tools("dead"), tool_choice={**choice, "server_label": "dead"})  # type: ignore[arg-type]
    assert dead.output[0].type == "mcp_list_tools" and dead.output[0].error and dead.output_text == "No tools."  # type: ignore[union-attr]
    assert fake.requests[-1].params.constraint is None
