"""OpenAI's tool calling and reasoning fields <-> :mod:`mlxr_core.chat.tools`."""

from __future__ import annotations

import json
from typing import Any

from mlxr_core.chat.parsing import Text, Tool, ToolCall
from mlxr_core.chat.tools import ReplyReader, ToolChoice
from mlxr_core.errors import RequestError
from mlxr_plugins.apis.openai import schemas as s


def tool_request(body: s.ChatCompletionRequest) -> tuple[list[Tool], ToolChoice, bool]:
    """The request's tools, tool choice and whether several calls may be made at once."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise RequestError(f"tools of type {tool.type!r} are not supported", field=f"tools[{i}].type")
        function = tool.function
        tools.append(Tool(function.name, function.description or "", function.parameters or {"type": "object", "properties": {}}))
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        mode = choice_mode(choice, tools)
    else:
        mode = ToolChoice("function", choice.function.name)
    return tools, mode, body.parallel_tool_calls is not False


def choice_mode(choice: str | None, tools: list[Tool]) -> ToolChoice:
    """A ``tool_choice`` given as a word, or left out (``auto`` with tools, else ``none``)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice not in ("none", "auto", "required"):
        raise RequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
            field="tool_choice",
        )
    return ToolChoice(choice)


def message_dict(message: s.ChatMessage, rendered: dict[str, Any]) -> dict[str, Any]:
    """``rendered`` (role and text) with the message's tool calls or the call it answers."""
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments_text(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        rendered["tool_call_id"] = message.tool_call_id or ""
        if message.name:
            rendered["name"] = message.name
    return rendered


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def response_calls(calls: list[ToolCall]) -> list[s.ResponseToolCall]:
    return [s.ResponseToolCall(call.id, s.ResponseFunction(call.name, call.arguments)) for call in calls]


def assistant_message(reader: ReplyReader, text: str) -> tuple[s.AssistantMessage, int]:
    """The whole reply as a message, and how many calls it made."""
    content, reasoning, calls = reader.whole(text)
    message = s.AssistantMessage(content=content or (None if calls else ""))
    if calls:
        message.tool_calls = response_calls(calls)
    if reasoning:
        message.reasoning_content = reasoning
    return message, len(calls)


def deltas(pieces: list[Text | ToolCall], first_index: int) -> list[s.ChatDelta]:
    """Streamed deltas of ``pieces``: text as ``content`` or ``reasoning_content``; a call as its
    header (index, id, type, name), then its arguments, as OpenAI streams them. Calls are numbered
    from ``first_index``."""
    out = []
    index = first_index
    for piece in pieces:
        if isinstance(piece, Text):
            if piece.kind == "reasoning":
                out.append(s.ChatDelta(reasoning_content=piece.text))
            else:
                out.append(s.ChatDelta(content=piece.text))
            continue
        header = s.DeltaToolCall(index, s.DeltaFunction(name=piece.name, arguments=""), id=piece.id, type="function")
        out.append(s.ChatDelta(tool_calls=[header]))
        out.append(s.ChatDelta(tool_calls=[s.DeltaToolCall(index, s.DeltaFunction(arguments=piece.arguments))]))
        index += 1
    return out
