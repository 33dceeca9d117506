"""gpt-oss's Harmony format: every reply is a run of messages, each a header and a body,

``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``

(the prompt opened the first with ``<|start|>assistant``). The ``analysis`` channel is reasoning,
``final`` the answer, and a ``commentary`` message addressed ``to=functions.NAME`` (before or after
the channel, with ``<|constrain|>json`` or a bare ``json`` content type) is a call whose body is
its JSON arguments; ``commentary`` with no recipient is a preamble the user sees. A turn ends with
``<|return|>`` (the answer) or ``<|call|>``, never with ``<|end|>``, which only closes a message.

The markup is made of special tokens the engine keeps in the text for this parser, which never
lets one through: text that is not Harmony (no header) is content, minus any markup token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from mlxr_core.chat.parsing import Text, Tool, ToolCall
from mlxr_core.model.chat_template import render_chat_template
from mlxr_plugins.parsers.harmony_template import TOOLS_TEMPLATE
from mlxr_plugins.parsers.tools import held_back

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
#: Every special token of the markup; the engine keeps them in the text this parser reads.
MARKUP = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
#: The namespace of the client's functions: ``to=functions.get_weather``.
FUNCTIONS = "functions."
#: A header never spans lines and is short; text that does is not Harmony.
HEADER_LIMIT = 256

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")


def strip_markup(text: str) -> str:
    """``text`` without Harmony's special tokens (what a client would see of it)."""
    for token in MARKUP:
        text = text.replace(token, "")
    return text


class HarmonyStream:
    """One reply's messages, parsed as they stream: reasoning and content as they come, a call
    when its message ends (the reply's end, for ``<|call|>`` ends generation)."""

    def __init__(self, role: str = "", header: str | None = "") -> None:
        #: What the prompt wrote of the first header (``assistant``).
        self._role = role
        #: The header read so far, or None inside a body.
        self._header: str | None = header
        self._buffer = ""
        #: The body's kind of text, or for a call (``self._callee``) none.
        self._kind: Literal["content", "reasoning"] = "content"
        self._callee = ""
        #: Whether any markup has come: before, text with no header is plain content.
        self._marked = False
        #: Blanks and markup between messages are not text.
        self._between = False

    @classmethod
    def after(cls, prompt: str) -> HarmonyStream:
        """A stream for the reply to ``prompt``: after ``<|start|>assistant``, as templates end,
        the reply goes on with the header; a prompt that ends inside a message's body (a template
        that opens ``final`` itself) goes on in it."""
        tail = prompt[prompt.rfind(START) + len(START):] if START in prompt else ""
        if any(token in tail for token in (END, CALL, RETURN)):
            return cls()
        if MESSAGE not in tail:
            return cls(role=tail)
        stream = cls(header=None)
        stream._open(tail[: tail.index(MESSAGE)])
        return stream

    def feed(self, text: str) -> list[Text | ToolCall]:
        self._buffer += text
        out: list[Text | ToolCall] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Text | ToolCall]:
        out: list[Text | ToolCall] = []
        if self._header is not None:
            if not self._marked:  # never Harmony: the text is the answer
                out.append(Text(strip_markup(self._header + self._buffer)))
        elif self._callee:
            out.extend(self._call(self._buffer))
        elif not self._between:
            out.append(Text(strip_markup(self._buffer), self._kind))
        self._buffer, self._header = "", ""
        return [piece for piece in out if not isinstance(piece, Text) or piece.text]

    # -- the state machine -----------------------------------------------------------------------

    def _step(self, out: list[Text | ToolCall]) -> bool:
        """Consume what can be decided of the buffer; True to go on."""
        if self._header is not None:
            return self._read_header(out)
        if self._between:
            return self._read_between(out)
        return self._read_body(out)

    def _read_header(self, out: list[Text | ToolCall]) -> bool:
        assert self._header is not None
        header, self._buffer = self._header + self._buffer, ""
        while (found := _first(header, (START, MESSAGE, END, CALL, RETURN))) is not None:
            index, token = found
            self._marked = True
            if token == START:  # a header again: the one before was empty
                header, self._role = header[index + len(START):], ""
                continue
            self._header, self._buffer = None, header[index + len(token):]
            if token == MESSAGE:
                self._open(self._role + header[:index])
            else:  # a message closed before any body: nothing to say
                self._between = True
            return True
        if CHANNEL in header or CONSTRAIN in header:
            self._marked = True
        if "\n" in header or len(header) > HEADER_LIMIT:  # not a header: text
            self._header, self._kind, self._callee = None, "content", ""
            self._buffer = strip_markup(header)
            return True
        self._header = header
        return False

    def _read_between(self, out: list[Text | ToolCall]) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(START):
            self._header, self._buffer, self._between, self._role = "", rest[len(START):], False, ""
            return True
        if rest.startswith(CHANNEL):  # a header with no <|start|>
            self._header, self._buffer, self._between, self._role = "", rest, False, ""
            return True
        if not rest or any(token.startswith(rest) for token in MARKUP):
            self._buffer = rest
            return False
        for token in (END, CALL, RETURN, MESSAGE, CONSTRAIN):  # stray markup
            if rest.startswith(token):
                self._buffer = rest[len(token):]
                return True
        self._buffer, self._between = rest, False  # text out of any message
        self._kind, self._callee = "content", ""
        return True

    def _read_body(self, out: list[Text | ToolCall]) -> bool:
        found = _first(self._buffer, MARKUP)
        if found is None:
            if not self._callee:
                keep = max(held_back(self._buffer, token) for token in MARKUP)
                out.append(Text(self._buffer[: len(self._buffer) - keep], self._kind))
                self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        index, token = found
        body, rest = self._buffer[:index], self._buffer[index + len(token):]
        self._marked = True
        if token in (MESSAGE, CONSTRAIN):  # stray: dropped
            self._buffer = body + rest
            return True
        if self._callee:
            out.extend(self._call(body))
        else:
            out.append(Text(body, self._kind))
        if token in (START, CHANNEL):
            self._header, self._role = ("" if token == START else CHANNEL), ""
            self._buffer = rest
        else:
            self._buffer, self._between = rest, True
        return True

    def _open(self, header: str) -> None:
        """Start the body of the message ``header`` describes."""
        recipient = _RECIPIENT.search(header)
        _, _, after = header.partition(CHANNEL)
        channel = _WORD.match(after)
        self._callee = recipient[1] if recipient and recipient[1] != "assistant" else ""
        self._kind = "reasoning" if channel and channel[1] == "analysis" else "content"

    def _call(self, body: str) -> list[Text | ToolCall]:
        """The call of a message to ``self._callee``; arguments that are not a JSON object leave
        the body as content."""
        name = self._callee.removeprefix(FUNCTIONS)
        try:
            arguments = json.loads(body)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return [Text(strip_markup(body))]
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


def _first(text: str, tokens: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest of ``tokens`` is in ``text``, and which it is."""
    found = [(text.find(token), token) for token in tokens]
    hits = [hit for hit in found if hit[0] >= 0]
    return min(hits) if hits else None


class HarmonyParser:
    """Harmony (gpt-oss), as a tool parser and as a reasoning parser; ``auto`` chooses it for a
    template that writes ``<|channel|>``."""

    markup_tokens = MARKUP

    def detect(self, template: str) -> int:
        return 4 if CHANNEL in template else 0

    def stream(self, prompt: str = "") -> HarmonyStream:
        return HarmonyStream.after(prompt)

    def forced_grammar(self, tools: list[Tool]) -> str:
        """Some reasoning, then a call to one of ``tools`` with arguments their schema allows:
        compact JSON (unless the schema's ``x-guidance`` says otherwise), and only the properties
        the schema lists where it is silent on ``additionalProperties``, nested objects too (the
        prompt shows the model a TypeScript type with just those)."""
        calls = [f"call_{i}" for i in range(len(tools))]
        lines = [
            f"start: analysis ({' | '.join(calls)})",
            'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
            r"THOUGHT: /(.|\n)+/",
        ]
        for rule, tool in zip(calls, tools, strict=True):
            header = json.dumps(f"commentary to={FUNCTIONS}{tool.name} ")
            schema: dict[str, Any] = {"x-guidance": {"whitespace_flexible": False}, **tool.forced_arguments_schema()}
            lines.append(f'{rule}: <|channel|> {header} <|constrain|> "json" <|message|> %json {json.dumps(schema)}')
        return "\n".join(lines) + "\n"

    def system_prompt(self, tools: list[Tool]) -> str:
        return render_chat_template(TOOLS_TEMPLATE, [], tools=[tool.as_openai() for tool in tools])

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "".join(
            f"{START}assistant to={FUNCTIONS}{call.name}{CHANNEL}commentary {CONSTRAIN}json"
            f"{MESSAGE}{call.arguments}{CALL}"
            for call in calls
        )

    def render_result(self, name: str | None, content: str) -> str:
        author = f"{FUNCTIONS}{name}" if name else "tool"
        return f"{START}{author} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}"
