"""OpenAI wire types: requests (decoded strictly, unknown fields ignored) and responses.

Requests are decoded by msgspec with its strict type rules (``"5"`` is not an integer, ``1`` is not
a boolean), so a wrong type or an out-of-range value becomes a 400 naming the field without hand
validation. Unknown fields are ignored because OpenAI clients send many we do not use; the ones we
know but cannot honour are declared here and refused by the routes when set.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

#: OpenAI's seed is an int64; MLX keys take a uint64, and the routes map one onto the other.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
#: -1 and 0 both mean "off" (vLLM clients send -1).
TopK = Annotated[int, Meta(ge=-1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class Request(Struct, forbid_unknown_fields=False):
    """Fields shared by chat completions and completions."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known to OpenAI clients; honoured only when a sampler plugin of the same name is installed.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    #: vLLM's extension for benchmarks: generate ``max_tokens`` tokens whatever the model says.
    ignore_eos: bool = False


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class ContentPart(Struct, forbid_unknown_fields=False):
    """One part of a message's list content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class ChatMessage(Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(Struct, forbid_unknown_fields=False):
    type: str


class ChatCompletionRequest(Request, forbid_unknown_fields=False, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None


class CompletionRequest(Request, forbid_unknown_fields=False, kw_only=True):
    #: A string, a list of one string, a list of token ids, or a list of one list of token ids.
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


# -- responses -------------------------------------------------------------------------------


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    #: Present (null until the last chunk) only when ``stream_options.include_usage`` is set.
    usage: Usage | UnsetType | None = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | UnsetType | None = UNSET


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "mlxr"
    object: str = "model"
    context_length: int | None = None


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
