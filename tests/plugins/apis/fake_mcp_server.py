"""A fake MCP server for the tests (the official ``mcp`` SDK): ``python fake_mcp_server.py MODE``
serves over stdio; :func:`make_server` gives the same server for streamable HTTP.

Modes: ``ok`` (tools ``add``, ``shout`` and ``pick``), ``hang`` (``add`` never answers), ``crash`` (the
process dies when ``add`` is called), ``dead`` (the process exits before it speaks)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, Literal


def make_server(mode: str = "ok") -> Any:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("fake")

    @server.tool()
    async def add(a: int, b: int) -> str:
        """Add two integers."""
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "crash":
            os._exit(3)
        return str(a + b)

    @server.tool()
    def shout(text: str) -> str:
        """The text in capitals."""
        return text.upper()

    @server.tool()
    def pick(side: Literal["left", "right"]) -> str:
        """The side taken (arguments a random model completes in a few tokens under the grammar)."""
        return f"{side} it is"

    return server


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "dead":
        sys.exit(1)
    make_server(mode).run("stdio")
