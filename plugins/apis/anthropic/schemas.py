"""Anthropic Messages API wire types: requests decoded strictly, responses and stream events.

Unknown fields are ignored (clients send ``metadata``, ``service_tier`` and betas we need not
read); known fields of the wrong type or out of range are a 400 naming them. Which block a turn may
hold, and what each block needs, the routes check by hand and the document states (``if``/``then``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from mlxr_core.http.requests import StopList

if TYPE_CHECKING:
    from mlxr_core.engine.request import Usage as EngineUsage

PositiveInt = Annotated[int, Meta(ge=1)]
#: Anthropic's temperature range is 0..1.
Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]


def when(field: str, value: Any, then: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema rule "when ``field`` is ``value``, ``then``"."""
    return {"if": {"properties": {field: {"const": value}}, "required": [field]}, "then": then}


def needs(**fields: dict[str, Any]) -> dict[str, Any]:
    """Those fields, present and of those schemas."""
    return {"required": list(fields), "properties": fields}


STRING = {"type": "string"}
NAME = {"type": "string", "minLength": 1}
TEXT_BLOCK = {"type": "object", **needs(type={"const": "text"}, text=STRING)}
#: The blocks a user turn and an assistant turn may hold (thinking: an earlier reply's, ignored).
USER_BLOCKS = ["text", "image", "tool_result"]
ASSISTANT_BLOCKS = ["text", "tool_use", "thinking", "redacted_thinking"]


class ImageSource(Struct, forbid_unknown_fields=False):
    """An ``image`` block's source: ``base64`` (``media_type``, ``data``) or a ``url``."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(Struct, forbid_unknown_fields=False):
    """A content block of a request: ``text``, ``image`` (a user turn's picture), ``tool_use``
    (an assistant turn's call), ``tool_result`` (a user turn's answer to one), ``thinking`` (an
    earlier reply's, ignored)."""

    type: str
    text: str | None = None
    #: ``tool_use``: the call's id, the tool's name and its input object.
    id: str | None = None
    name: str | None = None
    input: Any = None
    #: ``tool_result``: the call answered, and its output (text, or text blocks).
    tool_use_id: str | None = None
    content: str | list[Any] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    #: ``image``: where its bytes are.
    source: ImageSource | None = None
    #: A cache breakpoint (``{"type": "ephemeral"}``): mlxr caches every prefix anyway; usage
    #: reports cache writes only for a request that asked for them (:meth:`Usage.of`).
    cache_control: dict[str, Any] | None = None


#: A block as the routes read it: what its ``type`` needs is there.
RequestBlock = Annotated[ContentBlock, Meta(extra_json_schema={"allOf": [
    {"properties": {"type": {"enum": sorted({*USER_BLOCKS, *ASSISTANT_BLOCKS})}}},
    when("type", "text", needs(text=STRING)),
    when("type", "image", needs(source={"type": "object", "allOf": [
        when("type", "base64", needs(data=STRING)), when("type", "url", needs(url=STRING))]})),
    when("type", "tool_use", needs(id=NAME, name=NAME)),
    when("type", "tool_result", needs(tool_use_id=NAME) | {"properties": {
        "tool_use_id": NAME, "content": {"anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": TEXT_BLOCK}]}}}),
]})]  # fmt: skip


class ToolDefinition(Struct, forbid_unknown_fields=False):
    """A client tool: its name, description and the JSON schema of its input. A ``type`` other
    than ``custom`` names one of Anthropic's server tools, which this server does not run."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    #: Only client tools (``custom``, or no type): server tools are not run here.
    type: Annotated[str | None, Meta(extra_json_schema={"enum": ["custom", None]})] = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceFields(Struct, forbid_unknown_fields=False):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


#: ``tool_choice`` (or null): a ``tool`` one names the tool.
ToolChoice = Annotated[ToolChoiceFields | None, Meta(extra_json_schema=when("type", "tool", needs(name=NAME)))]


class MessageFields(Struct, forbid_unknown_fields=False):
    #: The system prompt is the top-level ``system`` field.
    role: Literal["user", "assistant"]
    content: str | list[RequestBlock]


def _blocks_of(role: str, kinds: list[str]) -> dict[str, Any]:
    return when("role", role, {"properties": {"content": {"items": {"properties": {"type": {"enum": kinds}}}}}})


#: A turn: the blocks its role may hold.
Message = Annotated[MessageFields, Meta(extra_json_schema={
    "allOf": [_blocks_of("user", USER_BLOCKS), _blocks_of("assistant", ASSISTANT_BLOCKS)]})]
#: Assistant turns without calls alone: a prefill with nothing before it but, at most, the system prompt.
LONE_PREFILL = {"items": {"properties": {"role": {"const": "assistant"}, "content": {"anyOf": [
    {"type": "string"}, {"type": "array", "not": {"contains": {"properties": {"type": {"const": "tool_use"}}}}}]}}}}
#: A conversation starts with a user turn or the system prompt (a lone prefill needs a system
#: prompt), and a ``tool_choice`` that forces a call (``any``, ``tool``) needs tools.
CONVERSATION = {"allOf": [
    {"if": {"properties": {"messages": LONE_PREFILL}},
     "then": needs(system={"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]})},
    {"if": needs(tool_choice={"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}),
     "then": needs(tools={"type": "array", "minItems": 1})},
]}  # fmt: skip


class Thinking(Struct, forbid_unknown_fields=False):
    type: Annotated[str, Meta(extra_json_schema={"enum": ["enabled", "disabled"]})]
    #: Reasoning tokens the reply may spend before its end-of-thinking marker is forced (mlxr
    #: takes any count, Anthropic 1,024 and up).
    budget_tokens: Annotated[int, Meta(ge=0)] | None = None


class CountTokensFields(Struct, forbid_unknown_fields=False, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    #: The system prompt: text, or text blocks.
    system: Annotated[str | list[ContentBlock] | None, Meta(extra_json_schema={"allOf": [
        {"anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": TEXT_BLOCK}]}]})] = None  # fmt: skip
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = None
    thinking: Thinking | None = None
    #: Chat template variables for this request (vLLM's field, an extension here), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesFields(CountTokensFields, forbid_unknown_fields=False, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: StopList | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None


#: The bodies of ``/v1/messages/count_tokens`` and ``/v1/messages``.
CountTokensRequest = Annotated[CountTokensFields, Meta(extra_json_schema=CONVERSATION)]
MessagesRequest = Annotated[MessagesFields, Meta(extra_json_schema=CONVERSATION)]


# -- responses -------------------------------------------------------------------------------


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class ThinkingBlock(Struct, tag_field="type", tag="thinking"):
    """The model's reasoning, split from its answer by the model's reasoning parser. Its
    ``signature`` is empty: there is nothing to verify it against."""

    thinking: str
    signature: str = ""


Block = TextBlock | ToolUseBlock | ThinkingBlock


class Usage(Struct):
    """Anthropic's split of the prompt: ``input_tokens`` neither read from nor written to the
    prefix cache, ``cache_read_input_tokens`` read from it, ``cache_creation_input_tokens``
    prefilled and stored in it for later requests; the three add up to the prompt. As Anthropic
    counts them, cache writes are reported only for a request that marks a ``cache_control``
    breakpoint; without one what mlxr stored on its own counts as ``input_tokens``."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, usage: EngineUsage, *, breakpoints: bool = False) -> Usage:
        read = usage.cached_tokens
        written = usage.cache_written_tokens if breakpoints else 0
        return cls(usage.prompt_tokens - read - written, usage.completion_tokens, written, read)


class MessageResponse(Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[Block]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class CountTokensResponse(Struct):
    input_tokens: int


# -- stream events (``event: <type>`` + ``data: <json>``) ---------------------------------------


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: MessageResponse


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: Block


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(Struct, tag_field="type", tag="signature_delta"):
    signature: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(Struct):
    stop_reason: str
    stop_sequence: str | None


class OutputUsage(Struct):
    """A ``message_delta``'s usage: cumulative totals, the prompt's split as :class:`Usage` has it
    (``message_start`` could not know yet what the prefix cache would give)."""

    output_tokens: int
    input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None

    @classmethod
    def of(cls, usage: EngineUsage, *, breakpoints: bool = False) -> OutputUsage:
        whole = Usage.of(usage, breakpoints=breakpoints)
        return cls(whole.output_tokens, whole.input_tokens, whole.cache_creation_input_tokens, whole.cache_read_input_tokens)


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopInfo
    usage: OutputUsage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(Struct, tag_field="type", tag="ping"):
    pass


class ErrorDetail(Struct):
    type: str
    message: str


class ErrorBody(Struct, tag_field="type", tag="error"):
    error: ErrorDetail


#: The data of one event of a streamed message (its ``type`` is also the event's name).
StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping | ErrorBody
)


encoder = msgspec.json.Encoder()
