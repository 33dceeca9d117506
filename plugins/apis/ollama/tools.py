"""Ollama's ``tools``, ``tool_calls`` and ``think`` <-> :mod:`mlxr_core.chat.tools`.

Ollama has no ``tool_choice``: offered tools are ``auto`` unless the mlxr extension
``options.tool_choice`` says otherwise (``none``, ``required`` or a tool's name). ``message.thinking`` carries the
reasoning when the request says ``think: true`` and the model has a reasoning parser.
"""

from __future__ import annotations

import json
from typing import Any

from mlxr_core.chat.parsing import Text, Tool, ToolCall
from mlxr_core.chat.tools import ToolChoice
from mlxr_core.errors import RequestError
from mlxr_plugins.apis.ollama import schemas as s


def tools_of(tools: list[Any] | None) -> list[Tool]:
    """``[{"type": "function", "function": {"name", "description", "parameters"}}]`` as tools."""
    out = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", field=f"tools[{i}]")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        elif not isinstance(parameters, dict):
            raise RequestError("parameters must be a JSON schema object", field=f"tools[{i}].function.parameters")
        out.append(Tool(function["name"], str(function.get("description") or ""), parameters))
    return out


def tool_choice(options: s.Options | None, tools: list[Tool]) -> ToolChoice:
    """``options.tool_choice`` (an mlxr extension) as a tool choice; ``auto`` when unset."""
    choice = options.tool_choice if options is not None else None
    if choice is None or choice == "auto":
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "required"):
        return ToolChoice(choice)
    if all(tool.name != choice for tool in tools):
        raise RequestError(
            f"options.tool_choice must be 'auto', 'none', 'required' or an offered tool's name, got {choice!r}",
            field="options.tool_choice",
        )
    return ToolChoice("function", choice)


def message_dict(i: int, message: s.Message) -> dict[str, Any]:
    """An Ollama message as a template's dict: calls (arguments are objects) and tool results."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError("a tool call needs function.name", field=f"messages[{i}].tool_calls[{j}]")
            arguments = function.get("arguments") or {}
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append({"id": f"call_{i}_{j}", "type": "function", "function": {"name": function["name"], "arguments": text}})
        rendered["tool_calls"] = calls
    if message.role == "tool" and message.tool_name:
        rendered["name"] = message.tool_name
    return rendered


def ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"function": {"name": call.name, "arguments": json.loads(call.arguments)}} for call in calls]


def assistant(pieces: list[Text | ToolCall]) -> s.AssistantMessage:
    """A message (or a streamed chunk's message) of ``pieces``."""
    content = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "content")
    thinking = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "reasoning")
    message = s.AssistantMessage(content)
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    if calls:
        message.tool_calls = ollama_calls(calls)
    if thinking:
        message.thinking = thinking
    return message
