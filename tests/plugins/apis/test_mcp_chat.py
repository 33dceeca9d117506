"""MCP tools offered to chat completions (``mcp.servers[].chat``), through the official ``openai``
client over a real socket: the fake MCP servers (the ``mcp`` SDK's) over stdio and streamable
HTTP, one that hangs, one that crashes, one that dies at start; a scripted model whose turns call
their tools."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
from scripted import ThreadedServer, make_ctx
from scripted_mcp import ScriptedTurns, call, prompt_of, stdio

from mlxr_core.config.schema import Config, McpConfig, McpServerConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

pytest.importorskip("mcp")
pytestmark = pytest.mark.slow  # starts MCP server processes

Serve = Callable[..., openai.OpenAI]
GO: Any = [{"role": "user", "content": "go"}]


@pytest.fixture
def fake() -> ScriptedTurns:
    return ScriptedTurns()


@pytest.fixture
def serve(fake: ScriptedTurns) -> Iterator[Serve]:
    """A server whose MCP servers are ``servers`` (``chat: true`` each): its openai client."""
    with contextlib.ExitStack() as stack:

        def start(*servers: McpServerConfig, **limits: Any) -> openai.OpenAI:
            mcp = McpConfig(servers=[attrs.evolve(server, chat=True) for server in servers], **limits)
            url = stack.enter_context(ThreadedServer(build_app(make_ctx(fake, mcp=mcp))))
            return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        yield start


def mcp_output(message: Any) -> list[dict[str, Any]]:
    """The reply's ``mcp_output`` extension field (the SDK keeps fields it does not know)."""
    return (message.model_extra or {}).get("mcp_output") or []


def sent(fake: ScriptedTurns) -> int:
    return sum(len(request.prompt_ids) for request in fake.requests)


def test_stdio_and_http_tools_run_between_turns(serve: Serve, fake: ScriptedTurns, mcp_http_url: str) -> None:
    client = serve(stdio("files", "ok", allowed_tools=["add"], timeout_s=60),
                   McpServerConfig(name="web", url=mcp_http_url, allowed_tools=["shout"], timeout_s=60))  # fmt: skip
    fake.replies = [call("add", a=2, b=3), call("shout", text="hi"), "Five, and HI."]
    completion = client.chat.completions.create(model="fake", messages=GO, max_tokens=500)
    choice = completion.choices[0]
    assert choice.message.content == "Five, and HI." and choice.finish_reason == "stop"
    assert choice.message.tool_calls is None  # the server ran them: nothing for the client to run
    made = mcp_output(choice.message)
    assert [(i["type"], i["server_label"], i["name"], i["output"], i["error"]) for i in made] == [
        ("mcp_call", "files", "add", "5", None), ("mcp_call", "web", "shout", "HI", None)]  # fmt: skip
    assert json.loads(made[0]["arguments"]) == {"a": 2, "b": 3}
    assert len(fake.requests) == 3 and "5" in prompt_of(fake, 1) and "HI" in prompt_of(fake, 2)  # results fed back
    assert completion.usage is not None and completion.usage.prompt_tokens == sent(fake)  # every turn counted

    # The request's own function: its call is the client's to run, and ends the loop.
    fake.replies = [call("lookup", q="x")]
    own = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    completion = client.chat.completions.create(model="fake", messages=GO, max_tokens=500, tools=own)  # type: ignore[list-item]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    assert [c.function.name for c in choice.message.tool_calls] == ["lookup"] and not mcp_output(choice.message)  # type: ignore[union-attr]

    # A forced MCP tool holds on the first turn only.
    fake.replies = [call("add", a=1, b=1), "Two."]
    forced: Any = {"type": "function", "function": {"name": "add"}}
    completion = client.chat.completions.create(model="fake", messages=GO, max_tokens=500, tool_choice=forced)
    assert completion.choices[0].message.content == "Two." and mcp_output(completion.choices[0].message)[0]["output"] == "2"
    first, second = fake.requests[-2:]
    assert first.params.constraint is not None and second.params.constraint is None


def test_streamed(serve: Serve, fake: ScriptedTurns, mcp_http_url: str) -> None:
    client = serve(McpServerConfig(name="web", url=mcp_http_url, timeout_s=60))
    fake.replies = ["Let me see. " + call("add", a=20, b=22), "It is 42."]
    stream = client.chat.completions.create(model="fake", messages=GO, max_tokens=500, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    pieces: list[tuple[str, Any]] = []
    usage = reason = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            assert not choice.delta.tool_calls
            if choice.delta.content:
                pieces.append(("text", choice.delta.content))
            pieces.extend(("mcp", item) for item in mcp_output(choice.delta))
    text = "".join(piece for kind, piece in pieces if kind == "text")
    assert text == "Let me see. It is 42." and reason == "stop"
    calls = [piece for kind, piece in pieces if kind == "mcp"]
    assert len(calls) == 1 and calls[0]["name"] == "add" and calls[0]["output"] == "42"
    at = pieces.index(("mcp", calls[0]))  # the call came between the turns' text
    assert "".join(p for k, p in pieces[:at] if k == "text") == "Let me see. "
    assert usage is not None and usage.prompt_tokens == sent(fake) and len(fake.requests) == 2


def test_a_hanging_or_crashing_server_is_an_error_the_model_is_told(serve: Serve, fake: ScriptedTurns) -> None:
    client = serve(stdio("stuck", "hang", timeout_s=20))
    fake.replies = [call("add", a=1, b=1), "Sorry."]
    completion = client.chat.completions.create(model="fake", messages=GO, max_tokens=500)
    [item] = mcp_output(completion.choices[0].message)
    assert item["output"] is None and item["error"]["code"] == "mcp_timeout"
    assert item["error"]["type"] == "mcp_error" and "did not answer within 20 s" in item["error"]["message"]
    assert completion.choices[0].message.content == "Sorry." and "Error:" in prompt_of(fake)

    client = serve(stdio("broken", "crash", timeout_s=60))
    fake.replies = [call("add", a=1, b=1), "Sorry."]
    stream = client.chat.completions.create(model="fake", messages=GO, max_tokens=500, stream=True)
    chunks = list(stream)
    [item] = [item for chunk in chunks for choice in chunk.choices for item in mcp_output(choice.delta)]
    assert item["output"] is None and item["error"]["code"] == "mcp_server_error"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sorry."


def test_failed_listing_bounds_and_refusals(serve: Serve, fake: ScriptedTurns) -> None:
    client = serve(stdio("files", "ok", allowed_tools=["add"], timeout_s=60), stdio("dead", "dead"), max_turns=2)
    fake.replies = [call("add", a=1, b=2)]  # calls on every turn
    completion = client.chat.completions.create(model="fake", messages=GO, max_tokens=500)
    made = mcp_output(completion.choices[0].message)
    assert made[0]["type"] == "mcp_list_tools" and made[0]["server_label"] == "dead" and made[0]["error"]["message"]
    assert [item["output"] for item in made[1:]] == ["3", "3"]  # two turns, each with its call
    assert completion.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="fake", messages=GO, max_tokens=500, n=2)
    assert error.value.body["param"] == "n"  # type: ignore[index]
    fake.replies = [call("add", a=1, b=2)]
    plain = client.chat.completions.create(model="fake", messages=GO, max_tokens=500, tool_choice="none")
    assert not mcp_output(plain.choices[0].message) and "add" in (plain.choices[0].message.content or "")
    assert plain.choices[0].finish_reason == "stop" and len(fake.requests) == 3  # one turn, nothing run


def test_the_real_engine_on_a_tiny_model(tiny_model_path: Path) -> None:
    """The engine's own path (chat template, the forced call's grammar, the reply's parser) on a tiny
    random GGUF model: a forced call of an MCP tool runs with the arguments the model wrote (a tool
    whose argument is one of two words: a random model's numbers run on past any max_tokens)."""
    config = Config(models=[ModelConfig(path=str(tiny_model_path), name="tiny", context_length=1024)], apis=["openai"],
                    mcp=McpConfig(servers=[stdio("files", "ok", allowed_tools=["pick"], timeout_s=60, chat=True)]))  # fmt: skip
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with ThreadedServer(build_app(ServerContext(config=config, host=host, engine=engine))) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            forced: Any = {"type": "function", "function": {"name": "pick"}}
            completion = client.chat.completions.create(model="tiny", messages=GO, max_tokens=48, temperature=0, tool_choice=forced)
    finally:
        engine.stop()
    [item] = [item for item in mcp_output(completion.choices[0].message) if item["type"] == "mcp_call"]
    arguments = json.loads(item["arguments"])
    assert item["name"] == "pick" and item["error"] is None and item["output"] == f"{arguments['side']} it is"
    assert completion.usage is not None and completion.usage.completion_tokens > 0
