"""A scripted ChatML model whose turns call tools, and the fake MCP servers' configs (shared by
test_mcp_tools and test_mcp_chat)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from scripted import FakeEngine, FakeTokenizer, ThreadedServer

from mlxr_core.config.schema import McpServerConfig

#: The fake MCP server (the ``mcp`` SDK's): ``python SERVER MODE`` serves it over stdio.
SERVER = str(Path(__file__).with_name("fake_mcp_server.py"))


class ChatMLTokenizer(FakeTokenizer):
    """A ChatML model: ``auto`` picks the ``hermes`` tool parser."""

    chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"


class ScriptedTurns(FakeEngine):
    """Each request answers the next of ``replies`` (the last one again when they run out)."""

    def __init__(self) -> None:
        super().__init__(context_length=8192)
        self.models["fake"] = attrs.evolve(self.models["fake"], tokenizer=ChatMLTokenizer())
        self.replies: list[str] = []

    def submit(self, request: Any, *, loop: Any = None) -> Any:
        self.REPLY = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        return super().submit(request, loop=loop)


def call(name: str, **arguments: Any) -> str:
    """A hermes tool call of ``name``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def stdio(name: str, mode: str, **extra: Any) -> McpServerConfig:
    """The fake server in ``mode`` (ok, hang, crash, dead) over stdio."""
    return McpServerConfig(name=name, command=[sys.executable, SERVER, mode], **extra)


def prompt_of(fake: FakeEngine, index: int = -1) -> str:
    """The text of the ``index``-th request's prompt (the fake tokenizer is byte-level)."""
    return bytes(fake.requests[index].prompt_ids).decode()


@contextlib.contextmanager
def http_mcp_server() -> Iterator[str]:
    """The fake server (mode ``ok``) over streamable HTTP, from a thread: its URL."""
    from fake_mcp_server import make_server

    with ThreadedServer(make_server("ok").streamable_http_app()) as url:
        yield f"{url}/mcp"
