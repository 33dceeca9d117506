"""``POST /v1/embeddings``: pooled final hidden states of a served model, in OpenAI's shape.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists; each
becomes one mean-pooled, L2-normalized vector (:meth:`~mlxr_core.engine.engine.Engine.embed`).
``encoding_format`` is ``float`` (JSON numbers) or ``base64`` (little-endian float32 bytes, what the
official client asks for by default). ``dimensions`` is refused: the vectors are the model's width.
"""

from __future__ import annotations

import base64
import functools
import struct
from typing import Annotated, Any, Literal

from litestar import Request
from msgspec import Meta, Struct

from mlxr_core.engine.client import EngineClient
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    loaded_model,
    prepare_in_thread,
    ready_engine,
    unless_disconnected,
)
from mlxr_plugins.apis.openai.schemas import ModelName

#: OpenAI's limit on inputs per request.
MAX_INPUTS = 2048


#: ``input``'s forms, as :func:`embedding_inputs` reads them: a text, token ids, or a list of
#: texts and token-id lists, none of them empty.
TEXT = {"type": "string", "minLength": 1}
TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
INPUT_FORMS = {"anyOf": [TEXT, TOKENS, {"type": "array", "items": {"anyOf": [TEXT, TOKENS]}, "minItems": 1, "maxItems": MAX_INPUTS}]}
#: ``dimensions`` is not supported (embeddings have the model's hidden size): null only.
NOT_SUPPORTED = {"type": "null", "description": "not supported by this server: embeddings have the model's hidden size"}


class EmbeddingRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: ModelName
    input: Annotated[str | list[Any], Meta(extra_json_schema={"allOf": [INPUT_FORMS]})]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, Meta(extra_json_schema=NOT_SUPPORTED)] = None
    user: str | None = None


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingList(Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


async def create_embeddings(
    ctx: ServerContext, body: EmbeddingRequest, request: Request[Any, Any, Any]
) -> EmbeddingList:
    """``POST /v1/embeddings``."""
    if body.dimensions is not None:
        raise RequestError(
            "dimensions is not supported by this server: embeddings have the model's hidden size",
            field="dimensions",
        )
    inputs = embedding_inputs(body.input)
    engine = ready_engine(ctx)
    info = await loaded_model(ctx, body.model)  # an unknown model is a 404 before tokenizing
    texts = [(i, item) for i, item in enumerate(inputs) if isinstance(item, str)]
    if texts:
        encode = functools.partial(_encode_all, engine, info.name, [text for _, text in texts])
        for (i, _), ids in zip(texts, await prepare_in_thread(ctx, request, encode), strict=True):
            inputs[i] = ids
    token_lists: list[list[int]] = inputs  # type: ignore[assignment]
    # By the name asked for: an adapter served as a model is refused there (it does not embed).
    result = await unless_disconnected(request, engine.embed_async(body.model, token_lists))
    data = [
        Embedding(index=i, embedding=_encode_vector(vector, body.encoding_format))
        for i, vector in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingList(data, body.model, usage)


def embedding_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """``input`` as a list of items, each a non-empty string or a non-empty list of token ids."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(is_token(token) for token in value):
        items = [[int(token) for token in value]]
    else:
        items = list(value)
    if not items:
        raise RequestError("input must not be empty", field="input")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input may hold at most {MAX_INPUTS} items, got {len(items)}", field="input")
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise RequestError(f"input[{i}] is an empty string", field="input")
        elif isinstance(item, list) and item and all(is_token(token) for token in item):
            items[i] = [int(token) for token in item]
        else:
            raise RequestError(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists",
                field="input",
            )
    return items


def is_token(value: Any) -> bool:
    """An integer, as JSON Schema's ``integer`` reads one (``5.0`` is one too)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _encode_all(engine: EngineClient, model: str, texts: list[str]) -> list[list[int]]:
    return [engine.encode(model, text, param="input") for text in texts]


def _encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector

