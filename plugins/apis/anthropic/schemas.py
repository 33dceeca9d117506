"""Anthropic Messages API wire types: requests decoded strictly, responses and stream events.

Unknown fields are ignored (clients send ``metadata``, ``service_tier`` and betas we need not
read); known fields of the wrong type or out of range are a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

PositiveInt = Annotated[int, Meta(ge=1)]
#: Anthropic's temperature range is 0..1.
Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]


class ContentBlock(Struct, forbid_unknown_fields=False):
    """A content block; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class Message(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentBlock]


class Thinking(Struct, forbid_unknown_fields=False):
    type: str


class CountTokensRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Any] | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, forbid_unknown_fields=False, kw_only=True):
    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tool_choice: Any = None


# -- responses -------------------------------------------------------------------------------


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class Usage(Struct):
    input_tokens: int
    output_tokens: int


class MessageResponse(Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[TextBlock]
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
    content_block: TextBlock


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopInfo(Struct):
    stop_reason: str
    stop_sequence: str | None


class OutputUsage(Struct):
    output_tokens: int


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


encoder = msgspec.json.Encoder()
