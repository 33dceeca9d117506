"""The server's MCP client (the official ``mcp`` SDK): the tools of the servers configured under
``mcp:`` (stdio commands and streamable-HTTP URLs), listed and called with a timeout each.

Every list or call opens its own session and closes it after, so a server that crashed is
started again by the next call and one that hangs holds nothing past its timeout. Any failure
(the command missing, the process dying, a refused connection, a timeout, an error result) comes
back as a :class:`ToolError` with a message the API turns into an error item: it never fails or
hangs the request that asked.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from mlxr_core.errors import MissingDependency

if TYPE_CHECKING:
    from mlxr_core.config.schema import McpServerConfig


@attrs.frozen
class McpTool:
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]


class ToolError(Exception):
    """A server or tool that failed; ``str()`` says how, for the error item, and ``code`` which
    way: ``mcp_timeout`` (no answer within the server's ``timeout_s``), ``mcp_tool_error`` (the
    tool answered with an error, or was not allowed), ``mcp_server_error`` (the rest)."""

    def __init__(self, message: str, code: str = "mcp_server_error"):
        super().__init__(message)
        self.code = code


def _sdk() -> Any:
    try:
        import mcp
    except ImportError as error:
        raise MissingDependency("mcp", "running MCP tools", extra="mcp") from error
    return mcp


@contextlib.asynccontextmanager
async def session(server: McpServerConfig) -> AsyncIterator[Any]:
    """An initialized client session with ``server``."""
    mcp = _sdk()
    with open(os.devnull, "w") as errlog:  # a stdio server's stderr
        if server.command:
            from mcp.client.stdio import stdio_client

            params = mcp.StdioServerParameters(command=server.command[0], args=list(server.command[1:]),
                                               env=server.env or None)  # fmt: skip
            transport: Any = stdio_client(params, errlog=errlog)
        else:
            from mcp.client.streamable_http import streamable_http_client

            transport = streamable_http_client(server.url or "")
        async with transport as streams, mcp.ClientSession(streams[0], streams[1]) as client:
            await client.initialize()
            yield client


def allowed(server: McpServerConfig, name: str) -> bool:
    return server.allowed_tools is None or name in server.allowed_tools


async def list_tools(server: McpServerConfig) -> list[McpTool]:
    """The tools ``server`` offers that its allowlist lets through; :class:`ToolError` on failure."""
    try:
        with anyio.fail_after(server.timeout_s):
            async with session(server) as client:
                listed = await client.list_tools()
    except MissingDependency:
        raise
    except TimeoutError:
        raise ToolError(f"MCP server {server.name!r} did not list its tools within {server.timeout_s:g} s",
                        "mcp_timeout") from None
    except Exception as error:  # a dead process, a refused connection, a protocol error
        raise ToolError(f"MCP server {server.name!r} failed: {_describe(error)}") from None
    return [McpTool(server.name, tool.name, tool.description or "", dict(tool.input_schema or {}))
            for tool in listed.tools if allowed(server, tool.name)]  # fmt: skip


async def call_tool(server: McpServerConfig, name: str, arguments: dict[str, Any]) -> str:
    """The text of tool ``name``'s result; :class:`ToolError` on failure, an error result included."""
    if not allowed(server, name):
        raise ToolError(f"tool {name!r} of MCP server {server.name!r} is not in its allowed_tools", "mcp_tool_error")
    try:
        with anyio.fail_after(server.timeout_s):
            async with session(server) as client:
                result = await client.call_tool(name, arguments)
    except MissingDependency:
        raise
    except TimeoutError:
        raise ToolError(f"tool {name!r} of MCP server {server.name!r} did not answer within {server.timeout_s:g} s",
                        "mcp_timeout") from None
    except Exception as error:
        raise ToolError(f"MCP server {server.name!r} failed: {_describe(error)}") from None
    text = result_text(result)
    if getattr(result, "is_error", False):
        raise ToolError(text or f"tool {name!r} failed", "mcp_tool_error")
    return text


def result_text(result: Any) -> str:
    """A call result's text parts joined; structured content as JSON where there is no text."""
    texts = [part.text for part in getattr(result, "content", None) or [] if getattr(part, "type", "") == "text"]
    if texts:
        return "\n".join(texts)
    structured = getattr(result, "structured_content", None)
    return json.dumps(structured) if structured is not None else ""


def _describe(error: BaseException) -> str:
    """An error's first cause inside exception groups (anyio's task groups raise them)."""
    inner = getattr(error, "exceptions", None)
    while isinstance(inner, tuple) and inner:
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
