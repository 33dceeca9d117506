"""Wire types of OpenAI's Responses API (``/v1/responses``): the request, decoded strictly with
unknown fields ignored as the other OpenAI routes do, and the response, its output items and
its streamed events. What an input item of each type needs, and which parts it may hold, the routes
check by hand and the document states (``if``/``then``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from mlxr_plugins.apis.openai.schemas import (
    FORCED_NEEDS_TOOLS,
    PositiveInt,
    Seed,
    Temperature,
    TopK,
    TopP,
    when,
)

#: Roles of an input message, and the content parts that carry text.
ROLES = ["system", "developer", "user", "assistant"]
TEXT_PARTS = ["input_text", "output_text", "text"]
STRING = {"type": "string"}
NAME = {"type": "string", "minLength": 1}
#: A part of text (``output``, a reasoning item's ``content`` and ``summary``).
TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {"type": {"enum": TEXT_PARTS}, "text": STRING}}
#: A part of a message's content: text, or an image by URL.
PART = {"type": "object", "required": ["type"], "properties": {"type": {"enum": [*TEXT_PARTS, "input_image"]}},
        "allOf": [{"if": {"properties": {"type": {"enum": TEXT_PARTS}}}, "then": {"required": ["text"], "properties": {"text": STRING}}},
                  when("type", "input_image", {"required": ["image_url"], "properties": {"image_url": STRING}})]}  # fmt: skip


def parts(part: dict[str, Any]) -> dict[str, Any]:
    """Content that is a string, or a list of such parts (or null)."""
    return {"anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": part}]}


#: Each input item's needs by ``type`` (a message when it has none).
ITEM_RULES = {"properties": {"type": {"enum": ["message", "function_call", "function_call_output", "reasoning", "compaction",
                                               "mcp_approval_response"]}}, "allOf": [
    {"if": {"properties": {"type": {"const": "message"}}},
     "then": {"required": ["role"], "properties": {"role": {"enum": ROLES}, "content": parts(PART)}}},
    when("type", "function_call", {"required": ["call_id", "name"], "properties": {"call_id": NAME, "name": NAME}}),
    when("type", "function_call_output", {"required": ["call_id"], "properties": {"call_id": NAME, "output": parts(TEXT_PART)}}),
    when("type", "reasoning", {"properties": {"content": parts(TEXT_PART),
                                              "summary": {"type": ["array", "null"], "items": TEXT_PART}}}),
    when("type", "compaction", {"required": ["encrypted_content"], "properties": {"encrypted_content": STRING}}),
    when("type", "mcp_approval_response", {"required": ["approval_request_id", "approve"],
                                           "properties": {"approval_request_id": STRING, "approve": {"type": "boolean"}}}),
]}  # fmt: skip


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
    ``function_call`` the model made earlier, the ``function_call_output`` answering it, a
    ``reasoning`` item an earlier response returned, or the ``compaction`` item of
    ``/v1/responses/compact`` (``encrypted_content``)."""

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
    encrypted_content: str | None = None
    approval_request_id: str | None = None
    approve: bool | None = None


Item = Annotated[InputItem, Meta(extra_json_schema=ITEM_RULES)]


class FunctionToolFields(Struct, forbid_unknown_fields=False):
    """A function the model may call (``{"type": "function", "name", "parameters", ...}``), or
    the tools of an MCP server the server runs (``{"type": "mcp", "server_label",
    "allowed_tools", "require_approval"}``, :mod:`mlxr_plugins.apis.openai.mcp_tools`)."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")] | None = None
    type: Annotated[str, Meta(extra_json_schema={"enum": ["function", "mcp"]})] = "function"
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    server_label: Annotated[str, Meta(min_length=1)] | None = None
    server_url: str | None = None
    allowed_tools: list[str] | None = None
    #: ``always`` (the default), ``never``, or ``{"never": {"tool_names": [...]}}``.
    require_approval: Annotated[str, Meta(extra_json_schema={"enum": ["always", "never"]})] | dict[str, Any] | None = None


#: A function needs its name, an MCP server its label (a server_url of the client's is refused).
FunctionTool = Annotated[FunctionToolFields, Meta(extra_json_schema={"allOf": [
    {"if": {"not": {"required": ["type"]}}, "then": {"required": ["name"], "properties": {"name": {"type": "string"}}}},
    when("type", "function", {"required": ["name"], "properties": {"name": {"type": "string"}}}),
    when("type", "mcp", {"required": ["server_label"], "not": {"required": ["server_url"]}}),
]})]  # fmt: skip


class NamedToolChoiceFields(Struct, forbid_unknown_fields=False):
    """``{"type": "function", "name": ...}``: the function the reply calls; ``{"type": "mcp",
    "server_label": ..., "name": ...}``: the tool of that MCP server it calls (first, then the
    model goes on as it will)."""

    type: Annotated[str, Meta(extra_json_schema={"enum": ["function", "mcp"]})]
    name: Annotated[str, Meta(min_length=1)]
    server_label: Annotated[str, Meta(min_length=1)] | None = None


NamedToolChoice = Annotated[NamedToolChoiceFields, Meta(extra_json_schema={"allOf": [
    when("type", "mcp", {"required": ["server_label"]})]})]  # fmt: skip


class TextFormat(Struct, forbid_unknown_fields=False):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, forbid_unknown_fields=False):
    #: ``json_schema`` carries its schema.
    format: Annotated[TextFormat | None, Meta(extra_json_schema=when("type", "json_schema", {
        "required": ["schema"], "properties": {"schema": {"type": "object"}}}))] = None  # fmt: skip


class Reasoning(Struct, forbid_unknown_fields=False):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesFields(Struct, forbid_unknown_fields=False):
    model: str
    input: str | Annotated[list[Item], Meta(extra_json_schema={"minItems": 1})]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    #: Beyond OpenAI's fields, as the chat routes accept them.
    top_k: TopK | None = None
    seed: Seed | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Annotated[str, Meta(extra_json_schema={"enum": ["none", "auto", "required"]})] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    store: Annotated[bool, Meta(description="false: the response is not kept, so no later request finds it by id")] = True
    stream: bool = False
    #: Run on after the request is answered: poll with GET, cancel with POST .../cancel, stream
    #: (again) with GET ?stream=true&starting_after=N. Needs ``store``.
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    #: Template variables for this request (vLLM's and llama.cpp's field), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None


#: A Responses body: a ``tool_choice`` that forces a call needs tools; ``background`` needs ``store``.
ResponsesRequest = Annotated[ResponsesFields, Meta(extra_json_schema={"allOf": [
    FORCED_NEEDS_TOOLS, when("background", True, {"properties": {"store": {"const": True}}})]})]  # fmt: skip


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


class McpListToolsItem(Struct, tag_field="type", tag="mcp_list_tools", omit_defaults=False):
    id: str
    server_label: str
    tools: list[dict[str, Any]]
    error: str | None = None


class McpCallItem(Struct, tag_field="type", tag="mcp_call", omit_defaults=False):
    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: str | None = None
    approval_request_id: str | None = None
    status: str = "completed"


class McpApprovalRequestItem(Struct, tag_field="type", tag="mcp_approval_request", omit_defaults=False):
    id: str
    server_label: str
    name: str
    arguments: str


OutputItem = MessageItem | FunctionCallItem | ReasoningItem | McpListToolsItem | McpCallItem | McpApprovalRequestItem


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
    status: Literal["completed", "incomplete", "failed", "in_progress", "cancelled", "queued"]
    object: str = "response"
    background: bool = False
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


class CompactFields(Struct, forbid_unknown_fields=False):
    """``POST /v1/responses/compact``: the conversation (``input`` after ``previous_response_id``'s),
    summarized by the model. ``prompt_cache_key`` and the like are accepted and ignored."""

    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[Item], Meta(min_length=1)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None


#: A compaction's body: something to compact, ``input`` or ``previous_response_id``.
CompactRequest = Annotated[CompactFields, Meta(extra_json_schema={"anyOf": [
    {"required": ["input"], "properties": {"input": {"not": {"type": "null"}}}},
    {"required": ["previous_response_id"], "properties": {"previous_response_id": {"type": "string"}}},
]})]  # fmt: skip


class CompactionItem(Struct, tag_field="type", tag="compaction", omit_defaults=False):
    """The summary of a compacted conversation; ``encrypted_content`` is opaque to clients, who
    send the item back as input (here: the summary's text, encoded, not encrypted)."""

    id: str
    encrypted_content: str
    created_by: str | None = None


class UserMessageItem(Struct, tag_field="type", tag="message", omit_defaults=False):
    """A user message a compaction keeps as it was."""

    id: str
    content: list[dict[str, Any]]
    role: str = "user"
    status: str = "completed"


class CompactedResponse(Struct, omit_defaults=False):
    """``/v1/responses/compact``'s answer: the conversation's user messages, then one compaction item."""

    id: str
    created_at: int
    output: list[UserMessageItem | CompactionItem]
    usage: ResponseUsage
    object: str = "response.compaction"


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
