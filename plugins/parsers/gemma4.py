"""Gemma 4's tool calls and thinking, both written in special tokens (which the engine keeps in the
text for these parsers: :attr:`markup_tokens`).

- Calls: ``<|tool_call>call:NAME{ARGS}<tool_call|>``, one or more back to back. ``ARGS`` is
  JSON-like: bare keys, strings between ``<|"|>`` delimiters (raw: no escapes, and ``{}``, ``,``,
  ``:`` or newlines inside), bare numbers, ``true``, ``false``, ``null``, nested ``{}`` and ``[]``.
  A model that hands over to the tool writes ``<|tool_response>`` next: nothing after it is its
  answer.
- Thinking: ``<|channel>thought\\n...<channel|>`` (the text up to the first newline names the
  channel). Templates open the block in the prompt when thinking follows a tool result, and
  close an empty one when thinking is off.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlxr_core.chat.parsing import Text, Tool, ToolCall
from mlxr_plugins.parsers.tools import MarkupStream, Result, _arguments, held_back

CALL, CALL_END, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"
QUOTE = '<|"|>'
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
_NAME = re.compile(r"call:([\w.\-]+)")
_KEY = re.compile(r"\s*([^\s:{}\[\],]+)\s*:")
_BARE = re.compile(r"[^\s,:{}\[\]]+")
_LITERAL = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class Incomplete(Exception):
    """The text ends inside the value: more may make it whole."""


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def parse_value(text: str, at: int) -> tuple[Any, int]:
    """The value starting at ``text[at]`` (after blanks) and where it ends.

    :raises Incomplete: ``text`` ends inside it. :raises ValueError: it is not a value."""
    at = _skip(text, at)
    if at >= len(text) or QUOTE.startswith(text[at:]):
        raise Incomplete
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise Incomplete
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text[at] == '"':  # a JSON string, as some models write them
        try:
            return json.JSONDecoder().raw_decode(text, at)
        except ValueError:
            raise (ValueError if '"' in text[at + 1 :] else Incomplete)() from None
    if text[at] in "{[":
        closing = "}" if text[at] == "{" else "]"
        items: list[Any] = []
        out: dict[str, Any] = {}
        at = _skip(text, at + 1)
        while True:
            if at >= len(text):
                raise Incomplete
            if text[at] == closing:
                return (out if closing == "}" else items), at + 1
            if closing == "}":
                key, at = parse_key(text, at)
                out[key], at = parse_value(text, at)
            else:
                value, at = parse_value(text, at)
                items.append(value)
            at = _skip(text, at)
            if at < len(text) and text[at] == ",":
                at = _skip(text, at + 1)
            elif at < len(text) and text[at] != closing:
                raise ValueError(f"expected , or {closing} at {at}")
    match = _BARE.match(text, at)
    if match is None or not _LITERAL.fullmatch(match[0]):
        if match is not None and match.end() == len(text):
            raise Incomplete  # "tr", "-1." ...
        raise ValueError(f"not a value at {at}")
    if match.end() == len(text):
        raise Incomplete  # a number may go on
    return json.loads(match[0]), match.end()


def parse_key(text: str, at: int) -> tuple[str, int]:
    """An object key (bare, or a string) and the position after its ``:``."""
    if text.startswith((QUOTE, '"'), at):
        key, at = parse_value(text, at)
        at = _skip(text, at)
        if at >= len(text):
            raise Incomplete
        if text[at] != ":" or not isinstance(key, str):
            raise ValueError(f"expected : at {at}")
        return key, at + 1
    match = _KEY.match(text, at)
    if match is None:
        if re.fullmatch(r"\s*[^\s:{}\[\],]*\s*", text[at:]):
            raise Incomplete
        raise ValueError(f"expected a key at {at}")
    return match[1], match.end()


def read_call(body: str) -> tuple[int, ToolCall | None] | None:
    """What followed ``<|tool_call>``: None while unfinished, else how much one call took and the
    call (None: not a call, which runs to its ``<tool_call|>``)."""
    close = body.find(CALL_END)
    invalid = None if close < 0 else (close + len(CALL_END), None)
    match = _NAME.match(body)
    if match is None or match.end() == len(body):
        return invalid
    try:
        arguments, end = parse_value(body, match.end())
    except Incomplete:
        return None
    except ValueError:
        return invalid
    rest = body[_skip(body, end) :]
    if not isinstance(arguments, dict):
        return invalid
    if rest.startswith(CALL_END):
        call = ToolCall(match[1], json.dumps(arguments, ensure_ascii=False))
        return len(body) - len(rest) + len(CALL_END), call
    return None if CALL_END.startswith(rest) else invalid


class Gemma4ToolStream(MarkupStream):
    starts = (CALL, RESPONSE)

    def close(self, marker: str, body: str) -> Result:
        if marker == RESPONSE:
            return None  # what follows a handover is the tool's, not the answer: held, then dropped
        result = read_call(body)
        if result is None:
            return None
        used, call = result
        return used, None if call is None else [call]

    def close_at_end(self, marker: str, body: str) -> list[ToolCall] | None:
        if marker == RESPONSE:
            return []
        result = read_call(body + CALL_END)  # the output may end before the closing token
        if result is None or result[1] is None or body[result[0] - len(CALL_END) :].strip():
            return None
        return [result[1]]


def _render(value: Any) -> str:
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_render(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_render(item) for item in value) + "]"
    return json.dumps(value)


class Gemma4ToolParser:
    """Gemma 4's ``<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|>`` calls."""

    markup_tokens = (CALL, CALL_END, QUOTE, RESPONSE)

    def detect(self, template: str) -> int:
        if CALL in template:
            return 3
        return 1 if "<|turn>" in template else 0

    def stream(self) -> Gemma4ToolStream:
        return Gemma4ToolStream()

    def system_prompt(self, tools: list[Tool]) -> str:
        declarations = "".join(
            f"<|tool>declaration:{tool.name}{_render({'description': tool.description, 'parameters': tool.parameters})}<tool|>"
            for tool in tools
        )
        return (
            "You can call functions. To call one, write <|tool_call>call:NAME{ARGUMENTS}<tool_call|> "
            'with string values between <|"|> marks, then stop. The available functions:\n' + declarations
        )

    def render_calls(self, calls: list[ToolCall]) -> str:
        rendered = []
        for call in calls:
            arguments = _arguments(call)
            body = _render(arguments) if isinstance(arguments, dict) else "{}"
            rendered.append(f"{CALL}call:{call.name}{body}{CALL_END}")
        return "".join(rendered)

    def render_result(self, name: str | None, content: str) -> str:
        return f"{RESPONSE}response:{name or 'tool'}{{value:{QUOTE}{content}{QUOTE}}}<tool_response|>"


class Gemma4ThinkingStream:
    """Reasoning inside ``<|channel>NAME\\n...<channel|>`` blocks, content around them; a partial
    marker is held back, and blanks after a block are not content."""

    def __init__(self, state: str = "start") -> None:
        # start (only blanks so far), content, name (the channel's), thinking
        self._state, self._buffer = state, ""

    def feed(self, text: str) -> list[Text]:
        self._buffer += text
        out: list[Text] = []
        while self._step(out):
            pass
        return [piece for piece in out if piece.text]

    def _step(self, out: list[Text]) -> bool:
        """Advance through the buffer; False once it needs more text."""
        buffer = self._buffer
        if self._state in ("start", "after"):
            rest = buffer.lstrip()
            if not rest or (self._state == "start" and CHANNEL.startswith(rest)):
                return False  # blanks or a marker's beginning so far
            if self._state == "after" or rest.startswith(CHANNEL):
                self._buffer = rest
            self._state = "content"
            return True
        if self._state == "content":
            index = buffer.find(CHANNEL)
            if index < 0:
                keep = held_back(buffer, CHANNEL)
                out.append(Text(buffer[: len(buffer) - keep]))
                self._buffer = buffer[len(buffer) - keep :]
                return False
            out.append(Text(buffer[:index]))
            self._state, self._buffer = "name", buffer[index + len(CHANNEL) :]
            return True
        if self._state == "name":
            ends = [i for i in (buffer.find("\n"), buffer.find(CHANNEL_END)) if i >= 0]
            if not ends:
                return False
            end = min(ends)
            self._state = "thinking"
            self._buffer = buffer[end + 1 :] if buffer[end] == "\n" else buffer[end:]
            return True
        end = buffer.find(CHANNEL_END)
        if end < 0:
            keep = held_back(buffer, CHANNEL_END)
            out.append(Text(buffer[: len(buffer) - keep], "reasoning"))
            self._buffer = buffer[len(buffer) - keep :]
            return False
        out.append(Text(buffer[:end], "reasoning"))
        self._state, self._buffer = "after", buffer[end + len(CHANNEL_END) :]
        return True

    def finish(self) -> list[Text]:
        text, self._buffer = self._buffer, ""
        if self._state == "thinking":
            return [Text(text, "reasoning")] if text else []
        return [Text(text)] if text and self._state != "name" and text.strip() else []


class Gemma4ThinkingParser:
    """Gemma 4's ``<|channel>thought\\n...<channel|>`` thinking blocks."""

    markup_tokens = (CHANNEL, CHANNEL_END)

    def detect(self, template: str) -> int:
        if CHANNEL in template:
            return 3
        return 2 if "<|think|>" in template else 0

    def stream(self, prompt: str) -> Gemma4ThinkingStream:
        opened = prompt.rfind(CHANNEL)
        if opened < 0 or CHANNEL_END in prompt[opened:]:
            return Gemma4ThinkingStream()
        return Gemma4ThinkingStream("thinking" if "\n" in prompt[opened:] else "name")
