"""The Responses API's ``mcp`` tools, run by the server (:mod:`mlxr_core.http.mcp_client`).

A request names servers configured under ``mcp:`` by ``server_label`` (``{"type": "mcp",
"server_label", "allowed_tools", "require_approval"}``; a ``server_url`` of the client's own is
refused: the operator chooses what the server runs). Their tools are listed (an
``mcp_list_tools`` item each, its ``error`` set for a server that failed) and offered to the
model beside the request's functions. When the model calls one, the server runs it and feeds the
result back, and the model goes on, turn after turn, at most ``mcp.max_turns`` turns and
``mcp.max_seconds`` seconds (then the response is ``incomplete``, reason ``max_turns``). Each call
is an ``mcp_call`` item, its ``error`` set for a tool or server that failed or hung (the model is
told the error and goes on). A call ``require_approval`` asks for (``always``, the default as in
OpenAI's API, or a tool not under ``{"never": {"tool_names": [...]}}``) ends the turn with an
``mcp_approval_request`` item; the follow-up (``previous_response_id``) answers it with an
``mcp_approval_response`` input item, and the call runs (approved) or the model is told it was
declined.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import msgspec

from mlxr_core.chat.parsing import Tool
from mlxr_core.chat.tools import ToolChoice
from mlxr_core.config.schema import McpServerConfig
from mlxr_core.engine.request import Finished
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.mcp_client import McpTool, ToolError, call_tool, list_tools
from mlxr_plugins.apis.openai import responses_schemas as r

#: What the model reads for a call the user declined.
DECLINED = "The user declined to run this tool call."


@attrs.define
class McpTools:
    """The ``mcp`` tools of one request: the servers, their tools by name, the approval rules."""

    servers: dict[str, McpServerConfig]
    tools: dict[str, McpTool] = attrs.field(factory=dict)
    approval: dict[str, Any] = attrs.field(factory=dict)
    listed: list[r.McpListToolsItem] = attrs.field(factory=list)

    def offered(self) -> list[Tool]:
        return [Tool(tool.name, tool.description, tool.input_schema or {"type": "object", "properties": {}})
                for tool in self.tools.values()]  # fmt: skip

    def needs_approval(self, tool: McpTool) -> bool:
        rule = self.approval.get(tool.server, "always")
        if isinstance(rule, str):
            return rule != "never"
        never = (rule.get("never") or {}).get("tool_names") or []
        return tool.name not in never

    async def call(self, server_label: str, name: str, arguments: str) -> tuple[str | None, str | None]:
        """(output, error) of one call."""
        output, error = await self.run(server_label, name, arguments)
        return output, None if error is None else str(error)

    async def run(self, server_label: str, name: str, arguments: str) -> tuple[str | None, ToolError | None]:
        """(output, the error) of one call."""
        try:
            parsed = msgspec.json.decode(arguments or "{}")
        except msgspec.DecodeError as error:
            return None, ToolError(f"the arguments are not JSON: {error}", "mcp_tool_error")
        if not isinstance(parsed, dict):
            return None, ToolError("the arguments are not a JSON object", "mcp_tool_error")
        try:
            return await call_tool(self.servers[server_label], name, parsed), None
        except ToolError as error:
            return None, error


async def open_tools(ctx: ServerContext, specs: list[tuple[int, r.FunctionTool]]) -> McpTools | None:
    """The request's ``mcp`` tools (``specs``: their indices in ``tools``), listed; None without any."""
    if not specs:
        return None
    configured = {server.name: server for server in ctx.config.mcp.servers}
    found = McpTools({})
    for i, spec in specs:
        if spec.server_url is not None:
            raise RequestError("this server runs only the MCP servers its operator configured (mcp.servers): "
                               "name one by server_label", field=f"tools[{i}].server_url")  # fmt: skip
        server = configured.get(spec.server_label or "")
        if server is None:
            raise RequestError(f"no MCP server {spec.server_label!r} is configured; configured: "
                               f"{', '.join(configured) or 'none'}", field=f"tools[{i}].server_label")  # fmt: skip
        found.servers[server.name] = server
        found.approval[server.name] = spec.require_approval if spec.require_approval is not None else "always"
        item = r.McpListToolsItem(f"mcpl_{uuid.uuid4().hex}", server.name, [])
        try:
            for tool in await list_tools(server):
                if spec.allowed_tools is not None and tool.name not in spec.allowed_tools:
                    continue
                if tool.name in found.tools:
                    raise RequestError(f"MCP tool {tool.name!r} is offered by two servers; narrow allowed_tools",
                                       field=f"tools[{i}].allowed_tools")  # fmt: skip
                found.tools[tool.name] = tool
                item.tools.append({"name": tool.name, "description": tool.description, "input_schema": tool.input_schema})
        except ToolError as error:
            item.error = str(error)
        found.listed.append(item)
    return found


def check_choice(mcp: McpTools | None, choice: Any, mode: ToolChoice) -> ToolChoice:
    """The tool choice the request starts with (``mode``, from ``choice`` as sent). A ``tool_choice``
    of type ``mcp`` must name a tool its server (one of the request's ``mcp`` tools) lists and the
    request allows; where that server failed to list its tools, the call cannot be forced and the
    model answers as it will (the server's ``mcp_list_tools`` item has the error)."""
    if not isinstance(choice, r.NamedToolChoiceFields) or choice.type != "mcp":
        return mode
    if mcp is None or choice.server_label not in mcp.servers:
        raise RequestError(f"tool_choice names MCP server {choice.server_label!r}, which is not among tools (add "
                           "its mcp tool)", field="tool_choice.server_label")  # fmt: skip
    if any(item.server_label == choice.server_label and item.error for item in mcp.listed):
        return ToolChoice("auto")
    tool = mcp.tools.get(choice.name)
    if tool is None or tool.server != choice.server_label:
        offered = sorted(name for name, tool in mcp.tools.items() if tool.server == choice.server_label)
        raise RequestError(f"tool_choice.name {choice.name!r} is not an offered tool's name of MCP server "
                           f"{choice.server_label!r}; offered: {', '.join(offered) or 'none'}", field="tool_choice.name")  # fmt: skip
    return mode


#: One generation turn over a chat (``first``: the request's first turn, where a forced tool
#: choice holds): its output items and how it finished.
Turn = Callable[[list[dict[str, Any]], bool], Awaitable[tuple[list[r.OutputItem], Finished]]]


async def run_turns(
    ctx: ServerContext, mcp: McpTools, turn: Turn, chat: list[dict[str, Any]], response: r.Response
) -> tuple[list[Finished], list[dict[str, Any]], list[r.OutputItem], bool]:
    """Generate, run the model's MCP calls, feed their results back, until a turn calls none,
    asks for an approval, or the bounds are reached. ``response.output`` gains every item.
    Returns the turns' finish events, the chat messages the loop added, the last turn's items
    when it called no MCP tool (the reply), and whether the bounds stopped the loop."""
    limits = ctx.config.mcp
    deadline = time.monotonic() + limits.max_seconds
    response.output.extend(mcp.listed)
    finishes: list[Finished] = []
    added: list[dict[str, Any]] = []
    for number in range(limits.max_turns):
        items, finished = await turn(chat + added, number == 0)
        finishes.append(finished)
        calls = [item for item in items if isinstance(item, r.FunctionCallItem) and item.name in mcp.tools]
        response.output.extend(item for item in items if item not in calls)
        if not calls:
            return finishes, added, items, False
        text = "".join(part.text for item in items if isinstance(item, r.MessageItem) for part in item.content)
        added.append({"role": "assistant", "content": text, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]})  # fmt: skip
        pending = False
        for call in calls:
            tool = mcp.tools[call.name]
            if mcp.needs_approval(tool):
                response.output.append(r.McpApprovalRequestItem(f"mcpr_{call.call_id}", tool.server, call.name, call.arguments))
                pending = True
                continue
            output, error = await mcp.call(tool.server, call.name, call.arguments)
            response.output.append(r.McpCallItem(f"mcp_{uuid.uuid4().hex}", tool.server, call.name, call.arguments, output, error))
            added.append({"role": "tool", "tool_call_id": call.call_id, "name": call.name,
                          "content": output if error is None else f"Error: {error}"})  # fmt: skip
        if pending:
            return finishes, added, [], False
        if time.monotonic() > deadline:
            break
    return finishes, added, [], True


async def answer_approvals(
    ctx: ServerContext, items: str | list[r.InputItem], previous: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], list[r.OutputItem]]:
    """Run (or decline) the calls the input's ``mcp_approval_response`` items answer, from the
    previous response's ``mcp_approval_request`` items: the chat messages and output items they add."""
    answers = [(i, item) for i, item in enumerate(items) if item.type == "mcp_approval_response"] if isinstance(items, list) else []
    if not answers:
        return [], []
    made: list[r.OutputItem] = []
    requests = {entry["id"]: entry for entry in (previous or {}).get("output", [])
                if isinstance(entry, dict) and entry.get("type") == "mcp_approval_request"}  # fmt: skip
    configured = {server.name: server for server in ctx.config.mcp.servers}
    mcp = McpTools(configured)
    added: list[dict[str, Any]] = []
    for i, item in answers:
        asked = requests.get(item.approval_request_id or "")
        if asked is None or asked["server_label"] not in configured:
            raise RequestError("no mcp_approval_request of the previous response has this id",
                               field=f"input[{i}].approval_request_id")  # fmt: skip
        call_id = asked["id"].removeprefix("mcpr_")
        if item.approve:
            output, error = await mcp.call(asked["server_label"], asked["name"], asked["arguments"])
            made.append(r.McpCallItem(f"mcp_{uuid.uuid4().hex}", asked["server_label"], asked["name"],
                                                 asked["arguments"], output, error, approval_request_id=asked["id"]))  # fmt: skip
            content = output if error is None else f"Error: {error}"
        else:
            content = DECLINED
        added.append({"role": "tool", "tool_call_id": call_id, "name": asked["name"], "content": content})
    return added, made
