"""Ollama's embedding routes: ``POST /api/embed`` and the legacy ``POST /api/embeddings``.

Both answer with the served model's mean-pooled, L2-normalized final hidden states
(:meth:`~mlxr_core.engine.engine.Engine.embed`). ``/api/embed`` takes ``input`` (a string or a list
of strings) and, with ``truncate`` (the default), cuts inputs longer than the model's context to fit;
without it such an input is a 400. An empty ``input`` loads nothing and returns no embeddings, as
Ollama does. The legacy route takes one ``prompt`` and returns one ``embedding``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from litestar import Request
from msgspec import Meta, Struct

from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.client import EngineClient
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import prepare_in_thread, ready_engine, unless_disconnected
from mlxr_plugins.apis.ollama import schemas as s

#: The router's model lookup (name, alias, ``NAME:latest``) -> the served model.
Resolver = Callable[[ServerContext, str], Awaitable[ModelInfo]]


class EmbedRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    model: s.ModelName
    #: A text (empty: nothing to embed), or texts none of which is empty.
    input: str | list[Annotated[str, Meta(extra_json_schema={"minLength": 1})]] = ""
    truncate: bool = True
    options: s.Options | None = None
    keep_alive: s.KeepAlive | None = None
    #: Not supported (embeddings have the model's hidden size): 0, Ollama's "unset", or null.
    dimensions: Annotated[int, Meta(extra_json_schema={"const": 0, "description": s.UNSUPPORTED})] | None = None


class EmbedResponse(Struct):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingsRequest(Struct, forbid_unknown_fields=False, kw_only=True):
    """The legacy ``/api/embeddings`` body."""

    model: s.ModelName
    prompt: str = ""
    options: s.Options | None = None
    keep_alive: s.KeepAlive | None = None


class EmbeddingsResponse(Struct):
    embedding: list[float]


async def create_embed(
    ctx: ServerContext, body: EmbedRequest, request: Request[Any, Any, Any], resolve: Resolver
) -> EmbedResponse:
    """``POST /api/embed``; ``resolve(engine, name)`` is the router's model resolver."""
    started = time.perf_counter_ns()
    if body.dimensions:
        raise RequestError("dimensions is not supported by this server", field="dimensions")
    _check_options(ctx, body.options)
    engine = ready_engine(ctx)
    info = await resolve(ctx, body.model)
    if isinstance(body.input, str):
        texts = [body.input] if body.input else []
    else:
        texts = list(body.input)
        if any(not text for text in texts):
            raise RequestError("input must not hold empty strings", field="input")
    if not texts:
        return EmbedResponse(info.name, [], time.perf_counter_ns() - started, 0, 0)
    encode = functools.partial(_token_lists, engine, info, texts, truncate=body.truncate)
    token_lists = await prepare_in_thread(ctx, request, encode)
    submitted = time.perf_counter_ns()
    result = await unless_disconnected(request, engine.embed_async(_asked(engine, body.model, info.name), token_lists))
    total = time.perf_counter_ns() - started
    return EmbedResponse(info.name, result.vectors, total, submitted - started, result.prompt_tokens)


async def create_embeddings(
    ctx: ServerContext, body: EmbeddingsRequest, request: Request[Any, Any, Any], resolve: Resolver
) -> EmbeddingsResponse:
    """``POST /api/embeddings`` (legacy): one ``prompt`` -> one ``embedding``."""
    _check_options(ctx, body.options)
    engine = ready_engine(ctx)
    info = await resolve(ctx, body.model)
    if not body.prompt:
        return EmbeddingsResponse([])
    encode = functools.partial(_token_lists, engine, info, [body.prompt], truncate=True)
    token_lists = await prepare_in_thread(ctx, request, encode)
    result = await unless_disconnected(request, engine.embed_async(_asked(engine, body.model, info.name), token_lists))
    return EmbeddingsResponse(result.vectors[0])


def _check_options(ctx: ServerContext, options: s.Options | None) -> None:
    """``options`` held to the rules a generation request's are (a 400 naming the option): an
    embedding uses none of them, but a body the document refuses is refused here too."""
    from mlxr_plugins.apis.ollama.routes import options_params

    options_params(ctx, options)


def _token_lists(engine: EngineClient, info: ModelInfo, texts: list[str], *, truncate: bool) -> list[list[int]]:
    """Each text's ids; with ``truncate``, cut to the model's context length. A long text's head
    alone is tokenized either way (:meth:`~mlxr_core.engine.engine.Engine.encode`)."""
    token_lists = [engine.encode(info.name, text, truncate=True, param="input") for text in texts]
    if truncate:
        return [ids[: info.context_length] for ids in token_lists]
    for i, ids in enumerate(token_lists):
        if len(ids) > info.context_length:
            raise RequestError(
                f"input[{i}] has more tokens than the context length ({info.context_length}); "
                "shorten it or set truncate",
                field="input",
            )
    return token_lists


def _asked(engine: Any, name: str, served: str) -> str:
    """The name to embed under: a LoRA adapter served as a model keeps its own, which the engine
    refuses (it does not embed), rather than its model's."""
    from mlxr_plugins.apis.ollama.routes import served_adapter

    return served_adapter(engine, name) or served
