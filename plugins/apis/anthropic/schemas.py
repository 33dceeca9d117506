"""Anthropic Messages API wire types: requests decoded strictly, responses and stream events.

Unknown fields are ignored (clients send ``metadata``, ``service_tier`` and betas we need not
read); known fields of the wrong type or out of range are a 400 naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

if TYPE_CHECKING:
    from mlxr_core.engine.request import Usage as EngineUsage

PositiveInt = Annotated[int, Meta(ge=1)]
#: Anthropic's temperature range is 0..1.
Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]


class ImageSource(Struct, forbid_unknown_fields=False):
    """An ``image`` block's source: ``base64`` (``media_type``, ``data``) or a ``url``."""

    type: str
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


class ToolDefinition(Struct, forbid_unknown_fields=False):
    """A client tool: its name, description and the JSON schema of its input. A ``type`` other
    than ``custom`` names one of Anthropic's server tools, which this server does not run."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(Struct, forbid_unknown_fields=False):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Message(Struct, forbid_unknown_fields=False):
    #: The system prompt is the top-level ``system`` field.
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Thinking(Struct, forbid_unknown_fields=False):
    type: str


class CountTokensRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    #: Chat template variables for this request (vLLM's field, an extension here), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, forbid_unknown_fields=False, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None


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
    prefilled and stored in it for later requests; the three add up to the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, usage: EngineUsage) -> Usage:
        read, written = usage.cached_tokens, usage.cache_written_tokens
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
    def of(cls, usage: EngineUsage) -> OutputUsage:
        whole = Usage.of(usage)
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
