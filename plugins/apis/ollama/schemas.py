"""Ollama wire types (see Ollama's docs/api.md): requests decoded strictly, responses encoded.

Unknown fields and unknown ``options`` are ignored, as Ollama does; a known field of the wrong type
or out of range is a 400 naming it (``options.temperature``). Fields we know but cannot honour are
declared so the routes can refuse them by name, and the document says so (``suffix`` only empty).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from mlxr_core.http.requests import StopStrings

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
#: -1 is "until the model stops", -2 "until the context is full"; both mean the context's room here.
NumPredict = Annotated[int, Meta(ge=-2)]
#: ``keep_alive`` as a Go duration (``"5m"``, ``"1h30m"``, ``"-1s"``, ``"0"``); a number is seconds.
GO_DURATION = r"^[+-]?(0|(([0-9]+\.?[0-9]*|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$"
KeepAlive = float | Annotated[str, Meta(extra_json_schema={"pattern": GO_DURATION})]
#: ``think``: on or off, or gpt-oss's effort. A model that does not think ignores it.
Think = bool | Literal["low", "medium", "high"]
#: What this server cannot honour, stated in the document.
UNSUPPORTED = "not supported by this server"


class Options(Struct, forbid_unknown_fields=False, omit_defaults=True):
    """The ``options`` Ollama maps to sampling. Others (``num_ctx``, ``num_gpu``, ...) are ignored."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    #: 0 or less: off.
    top_k: int | None = None
    min_p: Probability | None = None
    #: Negative: a random seed (Ollama's -1).
    seed: int | None = None
    num_predict: NumPredict | None = None
    stop: StopStrings | None = None
    # Honoured only when a sampler plugin provides them; ignored otherwise (logged at debug).
    repeat_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: An mlxr extension (Ollama has no tool choice; Ollama itself ignores unknown options):
    #: ``auto`` (the default), ``none``, ``required`` (some offered tool) or a tool's name, which
    #: constrains the reply to a call as OpenAI's ``tool_choice`` does.
    tool_choice: Annotated[str, Meta(min_length=1, max_length=128)] | None = None


#: A tool, and a call an earlier turn made: a function with a name (``parameters`` a JSON schema).
FUNCTION = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1},
            "parameters": {"type": ["object", "null"]}}}  # fmt: skip
TOOL = {"type": "object", "required": ["function"], "properties": {"function": FUNCTION}}
CALL = {"type": "object", "required": ["function"],
        "properties": {"function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}  # fmt: skip


class Message(Struct, forbid_unknown_fields=False):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: Annotated[list[Any], Meta(extra_json_schema={"items": CALL})] | None = None
    thinking: str | None = None
    tool_name: str | None = None


#: A model's name: never empty (which models exist, only the served list says).
ModelName = Annotated[str, Meta(min_length=1)]


class BaseRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: ModelName
    #: Ollama streams unless told not to.
    stream: bool = True
    options: Options | None = None
    #: ``"json"``, or a JSON schema the reply follows (``""`` and null: free text).
    format: Annotated[Any, Meta(extra_json_schema={"anyOf": [{"enum": ["json", "", None]}, {"type": "object"}]})] = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    #: Chat template variables for this request (vLLM's field, an extension here), over the model's.
    chat_template_kwargs: dict[str, Any] | None = None


class ChatFields(BaseRequest, forbid_unknown_fields=False, kw_only=True):
    messages: list[Message] | None = None
    tools: Annotated[list[Any], Meta(extra_json_schema={"items": TOOL})] | None = None


#: A chat body: ``options.tool_choice: "required"`` needs tools (with messages: without, the model
#: is only loaded).
ChatRequest = Annotated[ChatFields, Meta(extra_json_schema={
    "if": {"properties": {"messages": {"type": "array", "minItems": 1},
                          "options": {"type": "object", "required": ["tool_choice"],
                                      "properties": {"tool_choice": {"const": "required"}}}},
           "required": ["messages", "options"]},
    "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
})]  # fmt: skip


class GenerateFields(BaseRequest, forbid_unknown_fields=False, kw_only=True):
    #: /api/generate does not split out thinking: ``think`` is off or unset.
    think: Annotated[Think, Meta(extra_json_schema={"const": False, "description": UNSUPPORTED})] | None = None
    prompt: str | None = None
    system: str | None = None
    suffix: Annotated[str, Meta(extra_json_schema={"maxLength": 0, "description": UNSUPPORTED})] | None = None
    template: Annotated[str, Meta(extra_json_schema={"maxLength": 0, "description": UNSUPPORTED})] | None = None
    #: Token ids a previous /api/generate returned, continuing that conversation.
    context: list[Annotated[int, Meta(extra_json_schema={"minimum": 0})]] | None = None
    raw: bool = False
    images: list[str] | None = None


#: A generate body: a ``raw`` prompt has no template to place images in.
GenerateRequest = Annotated[GenerateFields, Meta(extra_json_schema={
    "if": {"properties": {"raw": {"const": True}}, "required": ["raw"]},
    "then": {"properties": {"images": {"type": ["array", "null"], "maxItems": 0}}},
})]  # fmt: skip


class ModelRequest(Struct, forbid_unknown_fields=False):
    """``/api/show`` and friends: ``model``, or ``name`` in older clients; one of them is required."""

    model: ModelName | UnsetType = UNSET
    name: ModelName | UnsetType = UNSET
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.model is UNSET and self.name is UNSET:
            raise ValueError("model is required")

    @property
    def model_name(self) -> str:
        return self.name if isinstance(self.model, UnsetType) else self.model  # type: ignore[return-value]


#: The body of ``/api/show``, its schema saying what ``__post_init__`` checks.
ShowRequest = Annotated[ModelRequest, Meta(extra_json_schema={"anyOf": [{"required": ["model"]}, {"required": ["name"]}]})]


# -- responses -------------------------------------------------------------------------------


class AssistantMessage(Struct):
    content: str
    role: str = "assistant"
    #: ``[{"function": {"name": ..., "arguments": {...}}}]``.
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    thinking: str | UnsetType = UNSET


class ChatChunk(Struct, omit_defaults=True):
    model: str
    created_at: str
    message: AssistantMessage
    done: bool
    done_reason: str | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET


class GenerateChunk(Struct, omit_defaults=True):
    model: str
    created_at: str
    response: str
    done: bool
    done_reason: str | UnsetType = UNSET
    context: list[int] | UnsetType = UNSET
    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET


class ModelDetails(Struct):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str
    parent_model: str = ""


class ListedModel(Struct):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ModelList(Struct):
    """``/api/tags``."""

    models: list[ListedModel]


class RunningModel(Struct):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class RunningList(Struct):
    """``/api/ps``."""

    models: list[RunningModel]


class Version(Struct):
    version: str


class ShowResponse(Struct):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class ErrorBody(Struct):
    error: str


encoder = msgspec.json.Encoder()
