"""The Ollama-compatible routes under ``/api``: chat, generate, embed, tags, show, ps, version.

A handler takes its body typed (decoded strictly by :class:`mlxr_core.http.frontend.JsonRequest`), maps Ollama's
``options`` onto :class:`~mlxr_core.engine.request.SamplingParams`, tokenizes in a worker thread,
submits to the engine and answers with one JSON object or, as Ollama does by default, a stream of
NDJSON lines (:mod:`mlxr_plugins.apis.ollama.streaming`).

``tools`` are offered to the model (its calls come back as ``message.tool_calls``), ``think``
splits the reasoning into ``message.thinking`` for a model with a reasoning parser (a model that does
not think answers as without it, where Ollama refuses: a 400 for a valid body), and ``format``
(``"json"`` or a JSON schema) is enforced while decoding. An mlxr extension, ``options.tool_choice``,
forces a call (Ollama has none). Differences from Ollama, each answered with a 400 naming the field
rather than silently ignored: ``suffix`` and ``template`` are not supported (``images``, base64,
go to a vision model). ``keep_alive`` is honoured as Ollama does (seconds, or a duration such as
``"5m"``; 0 unloads the model once the reply is sent, negative keeps it loaded; unset: the model's
``idle_unload_seconds``), except on a pinned model, which stays loaded; a chat without messages or a
generate without prompt loads the model (with ``keep_alive: 0``, unloads it). ``/api/ps`` lists the
models loaded now (:mod:`mlxr_core.engine.lifecycle`). ``/api/embed`` and ``/api/embeddings`` are
in :mod:`mlxr_plugins.apis.ollama.embed`; ``/api/blobs``, ``/api/create`` (LoRA adapters over a
served model) and ``/api/delete`` in :mod:`mlxr_plugins.apis.ollama.create`. ``/api/tags`` lists
LoRA adapters served as models of their own too, with ``details.parent_model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from typing import Any

import attrs
from litestar import Request, Response, Router, get, post
from litestar.params import JSONBody

from mlxr_core.chat.prompt import encode_chat
from mlxr_core.chat.tools import constraints_supported, model_parsers, prepare_chat
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.client import EngineClient
from mlxr_core.engine.lifecycle import parse_keep_alive
from mlxr_core.engine.request import Constraint, GenerationRequest, PromptImage, SamplingParams
from mlxr_core.errors import ModelNotFound, RequestError
from mlxr_core.http.access import admin_access
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    cap_max_tokens,
    collect,
    json_response,
    loaded_model,
    prepare_in_thread,
    ready_engine,
    room_for,
    submit,
)
from mlxr_core.http.images import ImageInput, load_images
from mlxr_core.http.openapi import Stream, documented
from mlxr_core.http.requests import sampling_params, template_variables
from mlxr_plugins.apis.ollama import embed as embedding
from mlxr_plugins.apis.ollama import models
from mlxr_plugins.apis.ollama import schemas as s
from mlxr_plugins.apis.ollama.errors import EXCEPTION_HANDLERS
from mlxr_plugins.apis.ollama.streaming import (
    NDJSON,
    ChatLines,
    GenerateLines,
    Timer,
    ndjson_response,
)
from mlxr_plugins.apis.ollama.tools import message_dict, tool_choice, tools_of

log = logging.getLogger(__name__)

#: The Ollama API version this frontend follows (clients gate features on it).
OLLAMA_API_VERSION = "0.12.0"
#: Roles a chat template may see.
ROLES = ("system", "user", "assistant", "tool")


#: What a route answers besides its annotations: errors in Ollama's shape.
ERRORS = documented(error=s.ErrorBody)


def make_router(ctx: ServerContext) -> Router:
    """The Ollama API as a Litestar router (the ``ollama`` entry of ``apis:``)."""

    # Ollama streams unless told not to; a stream ends with an error line if the request fails.
    @post("/chat", status_code=200, operation_class=documented(
        error=s.ErrorBody, response=s.ChatChunk, stream=Stream(NDJSON, (s.ChatChunk, s.ErrorBody))))
    async def chat(data: JSONBody[s.ChatRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return await create_chat(ctx, data, request)

    @post("/generate", status_code=200, operation_class=documented(
        error=s.ErrorBody, response=s.GenerateChunk, stream=Stream(NDJSON, (s.GenerateChunk, s.ErrorBody))))
    async def generate(data: JSONBody[s.GenerateRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return await create_generation(ctx, data, request)

    @get("/tags", sync_to_thread=False, operation_class=ERRORS)
    def tags() -> s.ModelList:
        engine = ready_engine(ctx)
        slots = engine.lifecycle.slots if engine.lifecycle is not None else {}
        served = [
            models.listed(engine.models[name]) if name in engine.models else models.listed_unloaded(slots[name])
            for name in engine.served
        ]
        # LoRA adapters served as models of their own, with their model as parent_model.
        adapters = [models.listed_adapter(name, base, engine.models.get(base)) for name, (base, _) in engine.adapters.items()]
        return s.ModelList(sorted([*served, *adapters], key=lambda listed: listed.name))

    @post("/show", status_code=200, operation_class=ERRORS)
    async def show(data: JSONBody[s.ShowRequest]) -> s.ShowResponse:
        engine = ready_engine(ctx)
        known = engine.models.get(served_name(engine, data.model_name))  # kept after an unload
        return models.shown(known or await resolve_model(ctx, data.model_name))

    @get("/ps", sync_to_thread=False, operation_class=ERRORS)
    def ps() -> s.RunningList:
        engine = ready_engine(ctx)
        return s.RunningList([models.running(info, slot) for info, slot in engine.loaded_models()])

    @get("/version", sync_to_thread=False, operation_class=ERRORS)
    def version() -> s.Version:
        return s.Version(OLLAMA_API_VERSION)

    @post("/embed", status_code=200, operation_class=ERRORS)
    async def embed(data: JSONBody[embedding.EmbedRequest], request: Request[Any, Any, Any]) -> embedding.EmbedResponse:
        return await embedding.create_embed(ctx, data, request, kept_alive(data))

    @post("/embeddings", status_code=200, operation_class=ERRORS)
    async def embeddings(
        data: JSONBody[embedding.EmbeddingsRequest], request: Request[Any, Any, Any]
    ) -> embedding.EmbeddingsResponse:
        return await embedding.create_embeddings(ctx, data, request, kept_alive(data))

    from mlxr_plugins.apis.ollama.create import create_routes

    return Router(
        path="/api",
        route_handlers=[chat, generate, tags, show, ps, version, embed, embeddings, *create_routes(ctx)],
        exception_handlers=EXCEPTION_HANDLERS,
        tags=["ollama"],
    )


async def create_chat(ctx: ServerContext, body: s.ChatRequest, request: Request[Any, Any, Any]) -> Response[Any]:
    """``POST /api/chat``."""
    timer = Timer()
    engine = ready_engine(ctx)
    if not body.messages and await unloaded(ctx, body, request):
        return json_response(s.ChatChunk(body.model, timer.created_at, s.AssistantMessage(""), True, "unload"))
    info = await kept_alive(body)(ctx, body.model)
    parsers = model_parsers(ctx, info)
    if body.think in (None, False):  # a model that does not think ignores think (it has no thinking to show)
        parsers = attrs.evolve(parsers, reasoning=None)
    # The options, format and tools are checked first: a load request with bad ones is a 400 too.
    params = options_params(ctx, body.options)
    params.constraint = format_constraint(ctx, body.format)
    tools = tools_of(body.tools)
    if not body.messages:  # Ollama's way to load a model: nothing to generate
        return json_response(s.ChatChunk(info.name, timer.created_at, s.AssistantMessage(""), True, "load"))
    inputs: list[ImageInput] = []
    messages = chat_messages(body.messages, inputs)
    images = await load_images(ctx.config.server, info, inputs)
    prepare = functools.partial(
        prepare_chat, info, parsers, messages, tools=tools, choice=tool_choice(body.options, tools),
        template_kwargs=think_variables(body), images=images,
    )
    setup = await prepare_in_thread(ctx, request, prepare)
    params.constraint = setup.constraint or params.constraint
    prompt_ids = setup.prompt_ids
    params.max_tokens = _max_tokens(ctx, engine, info, prompt_ids, body.options)
    model = served_adapter(engine, body.model) or info.name
    generation = GenerationRequest(model, prompt_ids, params, keep_special=setup.keep_special, images=images)
    handle = submit(ctx, generation)
    timer.submitted()
    lines = ChatLines(info.name, timer, setup.reader())
    if body.stream:
        return ndjson_response(ctx, handle, lines)
    reply = await collect(ctx, handle, request)
    return json_response(lines.whole(reply.text, reply.finished))


async def create_generation(
    ctx: ServerContext, body: s.GenerateRequest, request: Request[Any, Any, Any]
) -> Response[Any]:
    """``POST /api/generate``."""
    timer = Timer()
    _refuse_unsupported(body)
    for name, value in (("suffix", body.suffix), ("template", body.template)):
        if value:
            raise RequestError(f"{name} is not supported by this server", field=name)
    engine = ready_engine(ctx)
    if not body.prompt and not body.context and await unloaded(ctx, body, request):
        return json_response(s.GenerateChunk(body.model, timer.created_at, "", True, "unload"))
    info = await kept_alive(body)(ctx, body.model)
    params = options_params(ctx, body.options)  # checked first: a load request with bad ones is a 400 too
    params.constraint = format_constraint(ctx, body.format)
    if not body.prompt and not body.context:
        return json_response(s.GenerateChunk(info.name, timer.created_at, "", True, "load"))
    inputs = [ImageInput(data, f"images[{k}]") for k, data in enumerate(body.images or [])]
    images = await load_images(ctx.config.server, info, inputs)
    encode = functools.partial(_generate_prompt_ids, engine, info, body, images)
    prompt_ids = await prepare_in_thread(ctx, request, encode)
    params.max_tokens = _max_tokens(ctx, engine, info, prompt_ids, body.options)
    model = served_adapter(engine, body.model) or info.name
    handle = submit(ctx, GenerationRequest(model=model, prompt_ids=prompt_ids, params=params, images=images))
    timer.submitted()
    lines = GenerateLines(info.name, timer, prompt_ids)
    if body.stream:
        return ndjson_response(ctx, handle, lines)
    reply = await collect(ctx, handle, request)
    return json_response(lines.whole(reply.text, reply.token_ids, reply.finished))


# -- request -> engine -----------------------------------------------------------------------


async def resolve_model(ctx: ServerContext, name: str) -> ModelInfo:
    """The served model ``name`` names (:func:`served_name`), loaded (waiting while it loads)."""
    return await loaded_model(ctx, served_name(ready_engine(ctx), name))


def served_adapter(engine: EngineClient, name: str) -> str | None:
    """The LoRA adapter served as a model (``<model>:<adapter>``) that ``name`` names, with
    Ollama's ``:latest`` appended or not, or None: a request for it runs its model with it."""
    for candidate in (name, name.removesuffix(":latest")):
        if candidate in engine.adapters:
            return candidate
    return None


def served_name(engine: EngineClient, name: str) -> str:
    """The served model's name for ``name`` (a name or an alias); Ollama's default tag
    ``:latest`` may be appended."""
    if not name:
        raise RequestError("model is required", field="model")
    for candidate in dict.fromkeys((name, name.removesuffix(":latest"))):
        try:
            return engine.resolve(candidate)
        except ModelNotFound:
            continue
    served = engine.served
    error = ModelNotFound(name, served)
    error.message = f"model {name!r} not found (served: {', '.join(sorted(served)) or 'none'})"
    raise error


#: A request that may carry ``keep_alive``.
KeepsAlive = s.BaseRequest | embedding.EmbedRequest | embedding.EmbeddingsRequest


def keep_alive_seconds(body: KeepsAlive, info: ModelInfo | None, ctx: ServerContext) -> float | None:
    """``keep_alive`` in seconds (None: forever), unset: the model's ``idle_unload_seconds``."""
    if body.keep_alive is None:
        slot = ctx.engine.lifecycle.slots.get(info.name) if info and ctx.engine.lifecycle else None
        return slot.config.idle_unload_seconds if slot is not None else None
    try:
        if isinstance(body.keep_alive, str) and not re.search(s.GO_DURATION, body.keep_alive):
            raise ValueError(f"{body.keep_alive!r} is not a duration (a number of seconds, or like '5m', '1h30m', '0')")
        return parse_keep_alive(body.keep_alive)
    except ValueError as exc:
        raise RequestError(f"keep_alive: {exc}", field="keep_alive") from None


def kept_alive(body: KeepsAlive) -> embedding.Resolver:
    """A resolver (:func:`resolve_model`) that then applies ``body``'s ``keep_alive`` to the
    model, counted from its next idle moment."""

    async def resolve(ctx: ServerContext, name: str) -> ModelInfo:
        info = await resolve_model(ctx, name)
        ctx.engine.set_keep_alive(info.name, keep_alive_seconds(body, info, ctx))
        return info

    return resolve


async def unloaded(ctx: ServerContext, body: s.BaseRequest, request: Request[Any, Any, Any]) -> bool:
    """For an empty request with ``keep_alive: 0``: unload its model (once its running requests
    end, waiting for it up to ``engine.model_load_wait_s``); True if it asked for that. A pinned
    model stays loaded. Unloading is administration (:func:`~mlxr_core.http.access.admin_access`)."""
    if body.keep_alive is None or keep_alive_seconds(body, None, ctx) != 0:
        return False
    admin_access(ctx.config.server).check(request, "unloading a model")
    engine = ready_engine(ctx)
    name = served_name(engine, body.model)
    lifecycle = engine.lifecycle
    if lifecycle is not None and lifecycle.slots[name].pinned:
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.wrap_future(engine.unload_model(name)), ctx.config.engine.model_load_wait_s)
    return True


def chat_messages(messages: list[s.Message], images: list[ImageInput]) -> list[dict[str, Any]]:
    """Ollama messages as the dicts a chat template renders; a message's ``images`` (base64) are
    appended to ``images`` and come before its text as ``{"type": "image"}`` parts."""
    rendered = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise RequestError(
                f"unsupported role {message.role!r}; expected one of {', '.join(ROLES)}",
                field=f"messages[{i}].role",
            )
        rendered.append(message_dict(i, message))
        if message.images:
            images.extend(ImageInput(data, f"messages[{i}].images[{k}]") for k, data in enumerate(message.images))
            text = {"type": "text", "text": rendered[-1].get("content") or ""}
            rendered[-1]["content"] = [{"type": "image"} for _ in message.images] + [text]
    return rendered


def options_params(ctx: ServerContext, options: s.Options | None) -> SamplingParams:
    """Ollama's ``options`` (:func:`~mlxr_core.http.requests.sampling_params`)."""
    o = options or s.Options()
    return sampling_params(
        ctx,
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        min_p=o.min_p,
        seed=None if o.seed is None or o.seed < 0 else o.seed,  # negative: a random seed
        stop=o.stop,
        stop_param="options.stop",
        # Ollama's repeat_penalty looks back repeat_last_n tokens; ours over prompt and output.
        repetition_penalty=o.repeat_penalty,
        # Clients send their own defaults on every request: out-of-range values are clamped to
        # OpenAI's range, not refused.
        presence_penalty=_clamp(o.presence_penalty or 0.0, -2.0, 2.0),
        frequency_penalty=_clamp(o.frequency_penalty or 0.0, -2.0, 2.0),
    )


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _max_tokens(
    ctx: ServerContext, engine: EngineClient, info: ModelInfo, prompt_ids: list[int], options: s.Options | None
) -> int | None:
    """``num_predict``: positive is a bound, -1 and -2 mean "up to the context's end" (Ollama's
    "until the model stops" and "fill the context"), unset or 0 the server's default."""
    requested = options.num_predict if options else None
    if requested is not None and requested < 0:
        requested = info.context_length
    return cap_max_tokens(ctx, room_for(engine, info.name, prompt_ids, requested or None))


def _generate_prompt_ids(
    engine: EngineClient, info: ModelInfo, body: s.GenerateRequest, loaded: list[PromptImage] | None = None
) -> list[int]:
    """The prompt's ids: ``context`` from an earlier reply, then the prompt, templated as one user
    turn (after ``system``) unless ``raw`` or the model has no chat template; ``loaded``: the
    request's images, loaded."""
    tokenizer = info.tokenizer
    context = list(body.context or [])
    if any(not 0 <= token < tokenizer.vocab_size for token in context):
        raise RequestError(f"context token ids must be in [0, {tokenizer.vocab_size})", field="context")
    prompt = body.prompt or ""
    if not prompt:
        return context
    images = [{"type": "image"} for _ in body.images or []]
    if body.raw or tokenizer.chat_template is None:
        if images:
            raise RequestError("images need the model's chat template (raw: false)", field="images")
        ids = engine.encode(info.name, prompt, add_special_tokens=not context)
    else:
        messages = [{"role": "system", "content": body.system}] if body.system else []
        content: Any = [*images, {"type": "text", "text": prompt}] if images else prompt
        ids = encode_chat(info, [*messages, {"role": "user", "content": content}], images=loaded or ())
        if context and ids and ids[0] == tokenizer.bos_token_id:
            ids = ids[1:]  # one BOS, at the start of the conversation
    return context + ids


def format_constraint(ctx: ServerContext, value: Any) -> Constraint | None:
    """Ollama's ``format``: ``"json"`` (a JSON object, as Ollama's grammar has it) or a JSON schema."""
    if value in (None, ""):
        return None
    if value != "json" and not isinstance(value, dict):
        raise RequestError('format must be "json" or a JSON schema object', field="format")
    if not constraints_supported(ctx):
        raise RequestError("format (structured output) is not supported by this server", field="format")
    if value == "json":
        return Constraint(kind="json_object", field="format")
    return Constraint(kind="json_schema", value=value, field="format")


def _refuse_unsupported(body: s.BaseRequest) -> None:
    if body.think not in (None, False):
        raise RequestError(f"{body.model!r} does not support thinking", field="think")


def think_variables(body: s.BaseRequest) -> dict[str, Any]:
    """``think`` as the template's switches: ``false`` turns thinking off (``enable_thinking``),
    ``"low"``/``"medium"``/``"high"`` set the effort (gpt-oss), ``true`` turns it on."""
    if isinstance(body.think, str):
        return template_variables(body.chat_template_kwargs, effort=body.think)
    return template_variables(body.chat_template_kwargs, thinking=body.think)
