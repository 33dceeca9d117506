"""Request admission: what a served model is to other threads (:class:`ModelInfo`) and the checks
of a request against it, run in the caller's thread by both engines (the thread engine and the
engine process's client) before anything is queued."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.engine.request import model_defaults
from mlxr_core.errors import (
    ContextLengthExceeded,
    KvBudgetExceeded,
    Overloaded,
    RequestError,
)
from mlxr_core.model.tokenizer import encode_within

if TYPE_CHECKING:
    from mlxr_core.config.schema import EngineConfig
    from mlxr_core.engine.request import GenerationRequest
    from mlxr_core.model.audio import AudioFrontEnd
    from mlxr_core.model.tokenizer import Tokenizer
    from mlxr_core.model.vision import ImageProcessor, ImageTokens
    from mlxr_core.registry import Registry


@attrs.frozen
class ModelInfo:
    """What other threads may know about a served model (the tokenizer is thread-safe)."""

    name: str
    context_length: int
    created: int
    tokenizer: Tokenizer
    format: str
    model_type: str
    #: The resolved model file or folder, the bytes of its resident weights, the activation dtype
    #: and the checkpoint's format-specific metadata (for the APIs' model listings).
    path: str = ""
    nbytes: int = 0
    dtype: str = ""
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: Other names clients may use for this model (``models[].aliases``).
    aliases: tuple[str, ...] = ()
    #: Whether decode steps run compiled (``models[].compile_decode``).
    compiled_decode: bool = False
    #: The most bytes one token stands for (0: unknown); bounds a prompt's text before tokenizing.
    longest_token_bytes: int = 0
    #: A vision model's image processor (Pillow and numpy: any thread) and the prompt's image
    #: tokens; None for a text-only model.
    image_processor: ImageProcessor | None = None
    image_tokens: ImageTokens | None = None
    #: The ``models[]`` entry it was loaded from (its index; -1: none, a model built by hand).
    config_index: int = -1
    #: The tool and reasoning parsers chosen for it when it loaded (``models[].tool_parser``,
    #: ``reasoning_parser``; ``auto`` resolved against its chat template), by registered name;
    #: None: off.
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    #: A speech-to-text model's front end (numpy: any thread), turning samples at its
    #: ``sample_rate`` into the features it transcribes; None for a model that takes no audio.
    audio_front_end: AudioFrontEnd | None = None

    @property
    def transcribes(self) -> bool:
        """Whether this model turns audio into text (and continues no text prompt)."""
        return self.audio_front_end is not None

    @property
    def capabilities(self) -> list[str]:
        """What the model takes, in the names of Ollama's ``/api/show`` (front ends offer tool use
        and image upload by them): ``completion`` (text in, text out; ``transcription`` instead
        for a speech-to-text model), ``tools`` where a tool-call parser was chosen for it,
        ``vision`` with a vision tower, ``thinking`` with a reasoning parser."""
        found = ["transcription" if self.transcribes else "completion"]
        if self.tool_parser:
            found.append("tools")
        if self.image_processor is not None:
            found.append("vision")
        if self.reasoning_parser:
            found.append("thinking")
        return found
    #: The weights' parameter count, the vision side's included (packed ones as the values they hold).
    parameters: int = 0

    def check_prompt_text(self, text: str, param: str | None = "messages") -> None:
        """Refuse, before tokenizing it, a text the context cannot hold whatever its tokens: no
        token stands for more than :attr:`longest_token_bytes` bytes, hence characters, so a text
        longer than ``context_length`` times that needs more tokens than the context has (and
        tokenizing megabytes for nothing can take gigabytes)."""
        limit = self.context_length * self.longest_token_bytes
        if limit and len(text) > limit:
            raise ContextLengthExceeded(
                f"the text has {len(text)} characters, more than this model's context length "
                f"({self.context_length} tokens of at most {self.longest_token_bytes} characters) "
                "can hold; shorten it",
                field=param,
            )

    def encode(self, text: str, *, add_special_tokens: bool = True, param: str | None = "messages") -> list[int]:
        """``text``'s ids; ContextLengthExceeded naming ``param`` for a text of more tokens than the
        context holds, found by tokenizing a head of it, never all of it (:func:`encode_within`)."""
        self.check_prompt_text(text, param=param)
        ids = encode_within(self.tokenizer, text, self.context_length, add_special_tokens=add_special_tokens)
        if len(ids) > self.context_length:
            raise ContextLengthExceeded(
                f"the text has more tokens than this model's context length ({self.context_length}); shorten it",
                field=param,
            )
        return ids


def check_request(
    info: ModelInfo,
    request: GenerationRequest,
    *,
    config: EngineConfig,
    samplers: Registry,
    kv_bytes_per_token: int,
    state_bytes: int,
    queue_depth: int,
) -> None:
    """Check ``request`` against its model ``info`` and the queue; sets its model to the served
    name and an unset ``max_tokens`` to what the context allows.

    :param kv_bytes_per_token: the model's KV cache bytes per token (0: unknown).
    :param state_bytes: the fixed bytes of one sequence's recurrent layers.
    :param queue_depth: requests submitted and not yet running.
    :raises RequestError: an empty prompt, ids outside the vocabulary, images the model or prompt
        cannot take, sampling parameters no sampler takes.
    :raises ContextLengthExceeded, KvBudgetExceeded, Overloaded: as their names say.
    """
    request.model = info.name  # an alias runs on the model it names
    if info.transcribes:
        raise RequestError(
            f"the model {info.name!r} transcribes audio and continues no text prompt; send audio to "
            "/v1/audio/transcriptions", field="model",
        )  # fmt: skip
    prompt_tokens = len(request.prompt_ids)
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty", field="prompt")
    width = info.tokenizer.vocab_size
    if isinstance(request.prompt_ids, (str, bytes)) or not all(
        isinstance(token, numbers.Integral) and not isinstance(token, bool) and 0 <= token < width
        for token in request.prompt_ids
    ):
        raise RequestError(f"prompt_ids must be token ids in [0, {width})", field="prompt")
    check_images(info, request)
    params = request.params
    model_defaults(params, info.metadata.get("generation_defaults"))
    room = info.context_length - prompt_tokens
    if params.max_tokens is None:
        if room < 1:
            raise ContextLengthExceeded.tokens(prompt_tokens, 1, info.context_length)
        params.max_tokens = min(config.default_max_tokens, room)
    elif params.max_tokens > room:
        raise ContextLengthExceeded.tokens(prompt_tokens, params.max_tokens, info.context_length)
    budget = config.max_kv_bytes
    needed = (prompt_tokens + params.max_tokens) * kv_bytes_per_token + state_bytes
    if budget and needed > budget:
        raise KvBudgetExceeded(
            f"this request needs {needed} bytes of KV cache (prompt + max_tokens), more than "
            f"engine.max_kv_bytes ({budget}); shorten the prompt or lower max_tokens",
            field="max_tokens",
        )
    from mlxr_core.engine.decoding import SamplerContext, validate_sampling

    context = SamplerContext(
        request.prompt_ids, info.tokenizer, info.tokenizer.vocab_size,
        constraint_limits=config.constraint_limits,
    )  # fmt: skip
    validate_sampling(params, samplers, context)
    if queue_depth >= config.max_queue:
        raise Overloaded(f"{queue_depth} requests are waiting (engine.max_queue); retry later")


def check_images(info: ModelInfo, request: GenerationRequest) -> None:
    """A request's images fit its model and prompt (one run of image tokens per image)."""
    from mlxr_core.engine.images import PromptImages

    if info.image_tokens is None:
        if request.images:
            raise RequestError(
                f"the model {info.name!r} takes no images (it has no vision tower); send text only, "
                "or the image to a vision model", field="messages",
            )  # fmt: skip
        return
    PromptImages(request.prompt_ids, request.images, info.image_tokens)


def check_inputs(info: ModelInfo, inputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """An embedding or scoring job's token lists, checked against ``info``: at least one, none
    empty, ids in the vocabulary, each within the context; a speech model is refused."""
    if info.transcribes:
        raise RequestError(
            f"the model {info.name!r} transcribes audio; it has no text embeddings or scores", field="model"
        )  # fmt: skip
    if not inputs:
        raise RequestError("input must hold at least one item", field="input")
    vocab = info.tokenizer.vocab_size
    token_lists = [list(ids) for ids in inputs]
    for i, ids in enumerate(token_lists):
        if not ids:
            raise RequestError(f"input[{i}] is empty", field="input")
        if any(not 0 <= token < vocab for token in ids):
            raise RequestError(f"input[{i}]: token ids must be in [0, {vocab})", field="input")
        if len(ids) > info.context_length:
            raise ContextLengthExceeded(
                f"input[{i}] has {len(ids)} tokens, more than this model's context length "
                f"({info.context_length}); shorten it",
                field="input",
            )
    return token_lists
