"""Wire types of OpenAI's Responses API (``/v1/responses``): the request, decoded strictly with
unknown fields ignored as the other OpenAI routes do, and the response, its output items and
its streamed events."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from mlxr_plugins.apis.openai.schemas import PositiveInt, Seed, Temperature, TopK, TopP


class ContentPart(Struct, forbid_unknown_fields=False):
    """A part of an input message's content: ``input_text`` / ``output_text`` (``text``), an
    ``input_image`` (``image_url``: a data URI, or an ``http(s)`` URL fetched only when
    ``server.allow_remote_images`` is on; ``detail`` is accepted and ignored), or an
    ``input_file`` this server refuses."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(Struct, forbid_unknown_fields=False):
    """One item of ``input``: a message (``type`` ``message`` or absent, ``role``, ``content``), a
    ``function_call`` the model made earlier, the ``function_call_output`` answering it, or a
    ``reasoning`` item an earlier response returned."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    status: str | None = None


class FunctionTool(Struct, forbid_unknown_fields=False):
    """A function the model may call (``{"type": "function", "name", "parameters", ...}``)."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    type: str = "function"
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(Struct, forbid_unknown_fields=False):
    type: str
    name: str | None = None


class TextFormat(Struct, forbid_unknown_fields=False):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, forbid_unknown_fields=False):
    format: TextFormat | None = None


class Reasoning(Struct, forbid_unknown_fields=False):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(Struct, forbid_unknown_fields=False):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    #: Beyond OpenAI's fields, as the chat routes accept them.
    top_k: TopK | None = None
    seed: Seed | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    #: Template variables for this request (vLLM's and llama.cpp's field), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None


# -- the response ------------------------------------------------------------------------------


class OutputText(Struct, omit_defaults=False):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(Struct):
    text: str
    type: str = "reasoning_text"


class MessageItem(Struct, tag_field="type", tag="message", omit_defaults=False):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"


class FunctionCallItem(Struct, tag_field="type", tag="function_call", omit_defaults=False):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningItem(Struct, tag_field="type", tag="reasoning", omit_defaults=False):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    code: str
    message: str


class Response(Struct, omit_defaults=False):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class InputItemList(Struct, omit_defaults=False):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class Deleted(Struct, omit_defaults=False):
    id: str
    object: str = "response"
    deleted: bool = True


class StreamEvent(Struct, forbid_unknown_fields=False):
    """One streamed event (``response.created``, ``response.output_text.delta``, ...): its type,
    its number in the stream, and the fields its type carries (OpenAI's reference lists them)."""

    type: str
    sequence_number: int


encoder = msgspec.json.Encoder()
