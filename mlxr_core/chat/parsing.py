"""Splitting generated text into reasoning, content and tool calls.

Tool parsers (``mlxr_register_tool_parsers``) and reasoning parsers
(``mlxr_register_reasoning_parsers``) are chosen once per model (``models[].tool_parser``,
``models[].reasoning_parser``: ``auto`` asks each registered parser how strongly the chat template
points at its format, ``none`` turns parsing off). Per request they yield small stream objects that
take the text as the engine streams it and return :data:`Piece` s, holding back any text that may
still turn out to be markup: markup never reaches ``content``, streamed or not, and markup that
does not parse is given back as plain content.

A :class:`ChannelParser` (gpt-oss's Harmony) frames every reply in markup: one stream splits
reasoning, content and calls, its markup is made of special tokens the engine keeps in the text
for it, and the API layer uses it for each reply of the model whatever the request turns off.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from mlxr_core.config.loader import config_error
from mlxr_core.config.structure import Problem
from mlxr_core.errors import close_matches

#: ``models[].tool_parser`` / ``reasoning_parser`` values that name no plugin.
AUTO = "auto"
NONE = "none"


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class Tool:
    """A function the client offers the model (OpenAI's ``function`` object, Anthropic's tool)."""

    name: str
    description: str = ""
    #: JSON Schema of the arguments object.
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` form chat templates expect."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def forced_arguments_schema(self) -> dict[str, Any]:
        """The schema a forced call's arguments are decoded under: :attr:`parameters` with every
        object that lists ``properties`` closed to other keys (:func:`closed_objects`)."""
        closed: dict[str, Any] = closed_objects(self.parameters or {"type": "object"})
        return closed


#: Keywords by which a schema says what keys beyond its ``properties`` may hold.
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: Keywords holding a mapping of names to subschemas, and those holding one subschema or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "prefixItems", "additionalProperties", "contains")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that lists
    ``properties`` and is silent on other keys: where a forced tool call is concerned, a tool
    takes the arguments it declares and no others (as OpenAI's strict mode), so constrained
    decoding cannot add an empty or unknown key. A schema that says ``additionalProperties`` (or
    ``patternProperties``) keeps its word; an object without ``properties`` stays free-form.

    ``allOf`` and ``not`` subschemas are left as they are (closing each part of an ``allOf``
    would forbid its siblings' keys), and so are ``anyOf``/``oneOf`` alternatives beside
    ``properties`` of their own parent, for the same reason.
    """
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_VALUES or (key in ("anyOf", "oneOf") and "properties" not in schema):
            closed[key] = closed_objects(value)
        else:
            closed[key] = value
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_KEYWORDS):
        closed["additionalProperties"] = False
    return closed


@attrs.frozen
class ToolCall:
    """A complete call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = attrs.field(factory=new_call_id)


@attrs.frozen
class Text:
    """Generated text: answer ``content``, or ``reasoning`` (the model's thinking)."""

    text: str
    kind: Literal["content", "reasoning"] = "content"


Piece = Text | ToolCall


class ToolStream(Protocol):
    """One request's incremental tool-call parser."""

    def feed(self, text: str) -> list[Text | ToolCall]:
        """Take the next generated text; return the content and calls now certain."""
        ...

    def finish(self) -> list[Text | ToolCall]:
        """The end of the output: flush what was held back (unfinished markup becomes content)."""
        ...


class ToolParser(Protocol):
    """A model family's tool-call format, registered through ``mlxr_register_tool_parsers``."""

    def detect(self, template: str) -> int:
        """How strongly ``template`` points at this format: 0 not at all, 1 the model family's
        template, 2 or more the format's own markers. ``auto`` takes the highest above 0."""
        ...

    def stream(self) -> ToolStream:
        """A fresh parser for one request's output."""
        ...

    def system_prompt(self, tools: list[Tool]) -> str:
        """Instructions and tool definitions in this format, for templates that render no tools."""
        ...

    def render_calls(self, calls: list[ToolCall]) -> str:
        """Earlier calls as the model writes them, for templates that render no ``tool_calls``."""
        ...

    def render_result(self, name: str | None, content: str) -> str:
        """A tool result as a user turn's text, for templates that render no ``tool`` role."""
        ...


class ReasoningStream(Protocol):
    """One request's incremental reasoning splitter (a channel format's also yields calls)."""

    def feed(self, text: str) -> Sequence[Text | ToolCall]: ...

    def finish(self) -> Sequence[Text | ToolCall]: ...


class ReasoningParser(Protocol):
    """A thinking format, registered through ``mlxr_register_reasoning_parsers``."""

    def detect(self, template: str) -> int:
        """As :meth:`ToolParser.detect`."""
        ...

    def stream(self, prompt: str) -> ReasoningStream:
        """A fresh splitter; ``prompt`` is the rendered prompt (a template may open the thinking
        block itself, so the output starts inside it)."""
        ...


@runtime_checkable
class ThinkingMarkers(Protocol):
    """An optional capability of a reasoning parser whose thinking block is text between two
    markers (``<think>``, ``</think>``): a thinking budget (:mod:`mlxr_core.chat.thinking`) forces
    the end marker once the block has spent its tokens."""

    thinking_markers: tuple[str, str]


@runtime_checkable
class SpecialMarkup(Protocol):
    """An optional capability of a tool or reasoning parser whose markup is special tokens (Gemma
    4's ``<|tool_call>``, every :class:`ChannelParser`'s): the engine drops special tokens from the
    text it streams, except these, which the parser reads (and removes)."""

    markup_tokens: tuple[str, ...]


@runtime_checkable
class ChannelParser(Protocol):
    """A format whose markup frames every reply (gpt-oss's Harmony channels), registered as a
    tool parser, a reasoning parser or both: the API layer reads each reply of the model with its
    stream, whatever the request turns off, so that its markup never reaches a client."""

    #: The special tokens the markup is made of. The engine drops special tokens from the text it
    #: streams; these it keeps, for the stream to read (and remove).
    markup_tokens: tuple[str, ...]

    def stream(self, prompt: str) -> ReasoningStream:
        """A fresh parser for one reply: reasoning and content ``Text`` pieces and calls."""
        ...

    def forced_grammar(self, tools: list[Tool]) -> str:
        """A Lark grammar (as the structured-output sampler takes it) of a reply, in this format,
        that calls one of ``tools``."""
        ...


@attrs.define
class OutputSplitter:
    """Reasoning first, then tool calls in what is left: one request's whole pipeline. Calls a
    channel format's reasoning stream yields pass as they are; ``show_reasoning`` False drops the
    reasoning (a channel format's, which cannot be turned off)."""

    reasoning: ReasoningStream | None = None
    tools: ToolStream | None = None
    show_reasoning: bool = True

    def feed(self, text: str) -> list[Text | ToolCall]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [Text(text)], final=False)

    def finish(self) -> list[Text | ToolCall]:
        pieces = self._route(self.reasoning.finish() if self.reasoning else [], final=False)
        return pieces + self._route([], final=True)

    def _route(self, pieces: Sequence[Text | ToolCall], *, final: bool) -> list[Text | ToolCall]:
        out: list[Text | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(piece)
            elif piece.kind == "content" and self.tools is not None:
                out.extend(self.tools.feed(piece.text))
            elif piece.text and (piece.kind == "content" or self.show_reasoning):
                out.append(piece)
        if final and self.tools is not None:
            out.extend(self.tools.finish())
        return merge(out)


def merge(pieces: list[Text | ToolCall]) -> list[Text | ToolCall]:
    """Drop empty texts and join neighbours of one kind."""
    out: list[Text | ToolCall] = []
    for piece in pieces:
        if isinstance(piece, Text):
            if not piece.text:
                continue
            last = out[-1] if out else None
            if isinstance(last, Text) and last.kind == piece.kind:
                out[-1] = Text(last.text + piece.text, piece.kind)
                continue
        out.append(piece)
    return out


def split_all(splitter: OutputSplitter, text: str) -> tuple[str, str, list[ToolCall]]:
    """A whole reply as ``(content, reasoning, calls)``."""
    pieces = splitter.feed(text) + splitter.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "content")
    reasoning = "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == "reasoning")
    return content, reasoning, [p for p in pieces if isinstance(p, ToolCall)]


# -- choice -------------------------------------------------------------------------------------


def choose(registry: Any, choice: str, template: str | None) -> str | None:
    """The parser name ``choice`` selects for a model whose chat template is ``template``: the
    name itself, None for ``none``, and for ``auto`` the parser whose ``detect`` scores highest
    (:meth:`~mlxr_core.registry.Registry.choose`)."""
    return registry.choose(choice, template)  # type: ignore[no-any-return]


def parser_problems(config: Any, registries: Any) -> list[Problem]:
    """``models[].tool_parser`` / ``reasoning_parser`` values no loaded plugin registered, with the
    known parsers."""
    problems = []
    for i, model in enumerate(config.models):
        for key, registry in (
            ("tool_parser", registries.tool_parsers),
            ("reasoning_parser", registries.reasoning_parsers),
        ):
            value = getattr(model, key)
            if value in (AUTO, NONE) or value in registry:
                continue
            known = [AUTO, NONE, *registry.names()]
            problems.append(
                Problem(
                    ("models", i, key),
                    f"unknown parser {value!r} (available: {', '.join(known)}){close_matches(value, known)}",
                )
            )
    return problems


def validate_parser_choices(config: Any, registries: Any) -> None:
    """Refuse ``models[].tool_parser`` / ``reasoning_parser`` values no loaded plugin registered.

    :raises ConfigError: naming the key (``models[0].tool_parser``) and the known parsers.
    """
    problems = parser_problems(config, registries)
    if problems:
        raise config_error(config, problems)
