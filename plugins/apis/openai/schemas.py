"""OpenAI wire types: requests (decoded strictly, unknown fields ignored) and responses.

Requests are decoded by msgspec with its strict type rules (``"5"`` is not an integer, ``1`` is not
a boolean), so a wrong type or an out-of-range value becomes a 400 naming the field without hand
validation. Unknown fields are ignored because OpenAI clients send many we do not use; the ones we
know but cannot honour are declared here and refused by the routes when set; the document says so
(``echo`` only ``false``), and rules between fields are stated with ``if``/``then``, so a body the
document allows is one the routes serve.
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from mlxr_core.http.constraints import GrammarFields
from mlxr_core.http.requests import StopStrings

#: OpenAI's seed is an int64; MLX keys take a uint64, and the routes map one onto the other.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
#: Upper bounds of ``n`` and of the alternatives per token in ``top_logprobs``/``logprobs``.
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
#: -1 and 0 both mean "off" (vLLM clients send -1).
TopK = Annotated[int, Meta(ge=-1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
#: ``logit_bias``: token ids (JSON object keys) to a bias OpenAI bounds at 100 either way (the
#: routes and the logit_bias sampler check both, naming the field).
TOKEN_KEY = r"^[0-9]+$"
LogitBias = Annotated[dict[str, float], Meta(extra_json_schema={
    "propertyNames": {"pattern": TOKEN_KEY}, "allOf": [{"additionalProperties": {"minimum": -100, "maximum": 100}}]})]  # fmt: skip


def when(field: str, value: Any, then: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema rule "when ``field`` is ``value``, ``then``" (the field present)."""
    return {"if": {"properties": {field: {"const": value}}, "required": [field]}, "then": then}


#: What OpenAI's ``system_fingerprint`` says: the serving software and its version.
SYSTEM_FINGERPRINT = f"mlxr-{_version('mlxr')}"


#: A model's name: never empty (which models exist, only the served list says).
ModelName = Annotated[str, Meta(min_length=1)]


class Request(GrammarFields, forbid_unknown_fields=False):
    """Fields shared by chat completions and completions (vLLM's and llama.cpp's grammar fields
    among them)."""

    model: ModelName
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: StopStrings | None = None
    #: Choices per request (each its own generation, seeded ``seed + i`` when a seed is given).
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known to OpenAI clients; honoured only when a sampler plugin of the same name is installed.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    #: vLLM's extension for benchmarks: generate ``max_tokens`` tokens whatever the model says.
    ignore_eos: bool = False
    #: Structured output (chat and, as vLLM accepts it, completions).
    response_format: Format = None
    #: mlxr's extension: false drafts nothing for this request (``models[].speculative``).
    speculative: bool = True
    #: llama.cpp's per-request LoRA scales, on a request naming a base model: ``[{"id": i,
    #: "scale": s}]`` (:mod:`mlxr_plugins.apis.openai.adapters`).
    lora: list[LoraScale] | None = None
    #: mlxr's extension, on a request whose ``model`` names a LoRA adapter: its update times this.
    lora_scale: AdapterScale | None = None


#: How strongly a request's LoRA adapter applies (1: as its file has it, 0: not at all).
AdapterScale = Annotated[float, Meta(ge=-16.0, le=16.0)]


class LoraScale(Struct, forbid_unknown_fields=False):
    """One entry of llama.cpp's ``lora``: the model's adapter ``id`` at ``scale``."""

    id: Annotated[int, Meta(ge=0)]
    scale: AdapterScale


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class ImageURL(Struct, forbid_unknown_fields=False):
    #: A ``data:image/...;base64,...`` URI (remote URLs are refused).
    url: str
    detail: str | None = None


class ContentPart(Struct, forbid_unknown_fields=False):
    """One part of a message's list content: ``{"type": "text", "text": ...}``, or
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` for a vision model."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


#: A content part as the routes read it: its ``type``'s field is there.
Part = Annotated[ContentPart, Meta(extra_json_schema={"allOf": [
    when("type", "text", {"required": ["text"], "properties": {"text": {"type": "string"}}}),
    when("type", "image_url", {"required": ["image_url"], "properties": {"image_url": {"type": "object"}}}),
]})]  # fmt: skip


class FunctionCall(Struct, forbid_unknown_fields=False):
    name: str
    #: The arguments as JSON text (OpenAI's form); an object is accepted too.
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(Struct, forbid_unknown_fields=False):
    """A call an earlier assistant turn made."""

    function: FunctionCall
    id: str = ""
    type: str = "function"


class ChatMessage(Struct, forbid_unknown_fields=False):
    #: ``developer`` is OpenAI's new name for ``system``.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    #: A ``tool`` turn: the call it answers.
    tool_call_id: str | None = None


class FunctionDefinition(Struct, forbid_unknown_fields=False):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(Struct, forbid_unknown_fields=False):
    function: FunctionDefinition
    type: Annotated[str, Meta(extra_json_schema={"const": "function"})] = "function"


class NamedFunction(Struct, forbid_unknown_fields=False):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=False):
    function: NamedFunction
    type: str = "function"


class JsonSchemaFormat(Struct, forbid_unknown_fields=False):
    """``response_format.json_schema``: the output is enforced to validate against ``schema``
    whatever ``strict`` says."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, forbid_unknown_fields=False):
    """Structured output: free ``text``, any JSON object, or JSON validating a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


#: ``response_format`` (or null): of type ``json_schema``, it carries its schema.
Format = Annotated[ResponseFormat | None, Meta(extra_json_schema=when("type", "json_schema", {
    "required": ["json_schema"],
    "properties": {"json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}},
}))]  # fmt: skip


class PredictionPart(Struct, forbid_unknown_fields=False):
    type: Literal["text"]
    text: str


class Prediction(Struct, forbid_unknown_fields=False):
    """``prediction``: the output the client expects (OpenAI's Predicted Outputs), such as the
    file being edited; its tokens are drafted and verified, so the answer is the model's own."""

    type: Literal["content"]
    content: str | list[PredictionPart]


class ChatCompletionFields(Request, forbid_unknown_fields=False, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolDefinition] | None = None
    #: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
    tool_choice: Annotated[str, Meta(extra_json_schema={"enum": ["none", "auto", "required"]})] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: Chat template variables for this request (vLLM's and llama.cpp's field), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None
    #: OpenAI's reasoning effort, given to the template as ``reasoning_effort``.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    prediction: Prediction | None = None


#: A ``tool_choice`` that forces a call (``required``, or a named function) needs tools to call.
FORCED_NEEDS_TOOLS = {
    "if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}, "required": ["tool_choice"]},
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
}  # fmt: skip
#: A chat completion's body: ``top_logprobs`` (above 0) asks for ``logprobs: true``.
ChatCompletionRequest = Annotated[ChatCompletionFields, Meta(extra_json_schema={"allOf": [FORCED_NEEDS_TOOLS, {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}]})]  # fmt: skip
#: ``prompt``: a string, a list of one string, token ids, or a list of one list of token ids.
PROMPT_FORMS = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
     "minItems": 1, "maxItems": 1},
]}  # fmt: skip
#: What this server cannot honour, stated: no echo, no suffix, one candidate.
UNSUPPORTED = "not supported by this server"


class CompletionRequest(Request, forbid_unknown_fields=False, kw_only=True):
    prompt: Annotated[str | list[Any], Meta(extra_json_schema={"allOf": [PROMPT_FORMS]})]
    echo: Annotated[bool, Meta(extra_json_schema={"const": False, "description": UNSUPPORTED})] = False
    suffix: Annotated[str, Meta(extra_json_schema={"maxLength": 0, "description": UNSUPPORTED})] | None = None
    best_of: Annotated[int, Meta(extra_json_schema={"const": 1, "description": UNSUPPORTED})] | None = None
    logprobs: TopLogprobs | None = None


# -- responses -------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    #: Prompt tokens the prefix cache gave instead of a prefill.
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    #: Of a ``prediction``'s tokens, those the answer took as predicted, and those drafted and
    #: rejected (counted in ``completion_tokens`` by OpenAI; not here: they were not emitted).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    #: Of ``completion_tokens``, those of the reasoning (a model with a reasoning parser): its
    #: text re-encoded, at most ``completion_tokens``.
    reasoning_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    #: Present when the request brought a ``prediction`` or the model reasons.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class ResponseFunction(Struct):
    name: str
    arguments: str


class ResponseToolCall(Struct):
    id: str
    function: ResponseFunction
    type: str = "function"


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ResponseToolCall] | UnsetType = UNSET
    #: The model's thinking, split from ``content`` by the model's reasoning parser.
    reasoning_content: str | UnsetType = UNSET
    #: What the server's MCP tools did for this reply (``mcp.servers[].chat``; docs/agents.md).
    mcp_output: list[McpOutputItem] | UnsetType = UNSET


class McpCall(Struct, tag_field="type", tag="mcp_call"):
    """A call of an MCP tool the server ran between the model's turns (an extension: the chat API
    has no such item; the Responses API's ``mcp_call`` item, its ``error`` an error object)."""

    id: str
    server_label: str
    name: str
    #: The arguments the model gave, as JSON text.
    arguments: str
    #: The tool's result as the model read it; None where the call failed.
    output: str | None
    #: Why the call failed (``code``: ``mcp_timeout``, ``mcp_tool_error`` or ``mcp_server_error``);
    #: the model was told the message and went on.
    error: ErrorDetail | None = None


class McpListTools(Struct, tag_field="type", tag="mcp_list_tools"):
    """An MCP server whose tools could not be listed: its tools were not offered to the model."""

    id: str
    server_label: str
    error: ErrorDetail


McpOutputItem = McpCall | McpListTools


class TopLogprob(Struct):
    token: str
    logprob: float
    #: The token's UTF-8 bytes (a token may hold part of a character).
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    """``choices[].logprobs`` of a chat completion (and of each streamed chunk)."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(Struct):
    """``choices[].logprobs`` of a text completion (the legacy format)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT


class DeltaFunction(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed tool call: its first chunk has ``id``, ``type`` and the name; then arguments."""

    index: int
    function: DeltaFunction
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET
    #: The server's MCP calls and failed listings as they happen (see :class:`AssistantMessage`).
    mcp_output: list[McpOutputItem] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str = SYSTEM_FINGERPRINT
    #: Present (null until the last chunk) only when ``stream_options.include_usage`` is set.
    usage: Usage | UnsetType | None = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    system_fingerprint: str = SYSTEM_FINGERPRINT
    usage: Usage | UnsetType | None = UNSET


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "mlxr"
    object: str = "model"
    context_length: int | None = None
    #: The model a LoRA adapter served as a model of its own runs over (``models[].adapters``).
    parent: str | UnsetType = UNSET
    #: What the model takes (``completion``, ``tools``, ``vision``, ``thinking``; a speech-to-text
    #: model ``transcription``), as Ollama's ``/api/show`` names them; absent for a model not loaded yet.
    capabilities: list[str] | UnsetType = UNSET


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(Struct):
    error: ErrorDetail


encoder = msgspec.json.Encoder()
