"""The OpenAI-compatible routes: chat completions, completions, embeddings and models under ``/v1``.

A handler takes its body typed (decoded strictly by :class:`~mlxr_core.http.frontend.JsonRequest`), turns
it into :class:`~mlxr_core.engine.request.SamplingParams`, tokenizes in a worker thread (chat
templates and BPE are pure Python and must not stall the event loop), submits to the engine and
answers from the request's events (:mod:`mlxr_plugins.apis.openai.streaming`).
"""

from __future__ import annotations

import asyncio
import functools
import re
import uuid
from typing import Any

import attrs
from litestar import Request, Response, Router, get, post
from litestar.params import JSONBody
from msgspec import UNSET

from mlxr_core.chat.thinking import limit_thinking
from mlxr_core.chat.tools import ChatSetup, ToolChoice, model_parsers, prepare_chat
from mlxr_core.engine.client import EngineClient
from mlxr_core.engine.request import Constraint, GenerationRequest, RequestHandle, SamplingParams
from mlxr_core.errors import ContextLengthExceeded, RequestError
from mlxr_core.http.constraints import request_constraint
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    Reply,
    collect,
    json_response,
    loaded_model,
    prepare_in_thread,
    ready_engine,
    submit,
)
from mlxr_core.http.images import ImageInput, load_images
from mlxr_core.http.openapi import Stream, documented
from mlxr_core.http.requests import sampling_params, template_variables
from mlxr_plugins.apis.openai import schemas as s
from mlxr_plugins.apis.openai.adapters import adapter_choice
from mlxr_plugins.apis.openai.audio import audio_routes
from mlxr_plugins.apis.openai.decisions import decision_routes
from mlxr_plugins.apis.openai.embeddings import (
    EmbeddingList,
    EmbeddingRequest,
    create_embeddings,
    is_token,
)
from mlxr_plugins.apis.openai.errors import EXCEPTION_HANDLERS
from mlxr_plugins.apis.openai.logprobs import LogprobFormatter
from mlxr_plugins.apis.openai.mcp_chat import McpChat, McpChatChunks, ToolListings, chat_tools
from mlxr_plugins.apis.openai.mcp_chat import chat_completion as mcp_chat_completion
from mlxr_plugins.apis.openai.model_admin import model_admin_routes
from mlxr_plugins.apis.openai.responses import response_routes
from mlxr_plugins.apis.openai.streaming import (
    ChatChunks,
    CompletionChunks,
    ReasoningCount,
    ResponseMeta,
    sse_response,
    total_usage,
    usage_of,
)
from mlxr_plugins.apis.openai.tools import assistant_message, message_dict, tool_request

#: Chat roles a template may see; ``developer`` is OpenAI's new name for ``system``.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: Media type of a streamed reply.
SSE = "text/event-stream"
#: What a route answers besides its annotations: errors in OpenAI's shape, replies that may stream.
ERRORS = documented(error=s.ErrorBody)


def paths(path: str) -> list[str]:
    """A route under ``/v1`` and, as mlx-lm's and llama.cpp's servers have them, without it
    (``/chat/completions``, ``/models``, ...), for clients configured with the bare host."""
    return [f"/v1{path}", path]


def make_router(ctx: ServerContext) -> Router:
    """The OpenAI API as a Litestar router (the ``openai`` entry of ``apis:``): every route under
    ``/v1`` and unprefixed (:func:`paths`)."""
    listings = ToolListings()  # the MCP tools chat completions offer (mcp.servers[].chat)

    @post(paths("/chat/completions"), status_code=200, operation_class=documented(
        error=s.ErrorBody, response=s.ChatCompletion,
        stream=Stream(SSE, (s.ChatCompletionChunk, s.ErrorBody), end="data: [DONE]")))
    async def chat_completions(
        data: JSONBody[s.ChatCompletionRequest], request: Request[Any, Any, Any]
    ) -> Response[Any]:
        return await create_chat_completion(ctx, data, request, listings)

    @post(paths("/completions"), status_code=200, operation_class=documented(
        error=s.ErrorBody, response=s.Completion, stream=Stream(SSE, (s.Completion, s.ErrorBody), end="data: [DONE]")))
    async def completions(data: JSONBody[s.CompletionRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return await create_completion(ctx, data, request)

    @get(paths("/models"), sync_to_thread=False, operation_class=ERRORS)
    def models() -> s.ModelList:
        engine = ready_engine(ctx)
        names = sorted([*engine.served, *engine.adapters])
        return s.ModelList([_card(engine, name) for name in names])

    @get(
        paths("/models/{model_id:path}"),
        sync_to_thread=False,
        operation_class=documented(error=s.ErrorBody, path_strings=("model_id",)),
    )
    def model(request: Request[Any, Any, Any]) -> s.ModelCard:
        # Model names may contain slashes; a path parameter arrives with a leading one.
        name = str(request.path_params["model_id"]).lstrip("/")
        engine = ready_engine(ctx)
        return _card(engine, name if name in engine.adapters else engine.resolve(name))

    @post(paths("/embeddings"), status_code=200, operation_class=ERRORS)
    async def embeddings(data: JSONBody[EmbeddingRequest], request: Request[Any, Any, Any]) -> EmbeddingList:
        return await create_embeddings(ctx, data, request)

    return Router(
        path="/",
        route_handlers=[
            chat_completions, completions, models, model, embeddings, *response_routes(ctx),
            *model_admin_routes(ctx, paths), *decision_routes(ctx, paths), *audio_routes(ctx, paths),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        tags=["openai"],
    )


async def create_chat_completion(
    ctx: ServerContext, body: s.ChatCompletionRequest, request: Request[Any, Any, Any],
    listings: ToolListings | None = None,
) -> Response[Any]:
    """``POST /v1/chat/completions`` (``listings``: where the MCP tools it offers are kept)."""
    inputs: list[ImageInput] = []
    messages = chat_messages(body.messages, inputs)
    params = request_params(body, ctx, max_tokens=body.max_completion_tokens or body.max_tokens)
    if body.logprobs:
        params.logprobs = body.top_logprobs or 0
    elif body.top_logprobs:
        raise RequestError("top_logprobs needs logprobs: true", field="top_logprobs")
    ready_engine(ctx)  # a 503 while the engine is not ready
    info = await loaded_model(ctx, body.model)  # an unknown model is a 404 before any templating
    tools, tool_choice, parallel = tool_request(body)
    # The server's MCP tools (mcp.servers[].chat), unless the request turns tools off.
    mcp = None
    if body.tool_choice != "none":
        mcp = await chat_tools(ctx, listings or ToolListings(), {tool.name for tool in tools})
    if mcp is not None:
        if (body.n or 1) > 1:
            raise RequestError("n > 1 is not served with the server's MCP tools (mcp.servers[].chat); send "
                               "tool_choice 'none' to answer without them", field="n")  # fmt: skip
        tools = tools + mcp[0].offered()
        if body.tool_choice is None:
            tool_choice = ToolChoice("auto")
    variables = template_variables(body.chat_template_kwargs, effort=body.reasoning_effort)
    images = await load_images(ctx.config.server, info, inputs)
    prepare = functools.partial(
        prepare_chat, info, model_parsers(ctx, info), messages,
        tools=tools, choice=tool_choice, parallel=parallel, template_kwargs=variables, images=images,
    )
    prediction = None
    if body.prediction is not None:
        text = prediction_text(body.prediction)
        # No longer than the context (a 400 naming prediction), found from a head of the text: a
        # drafter scans its prediction as the output leaves it.
        prediction = await prepare_in_thread(
            ctx, request, functools.partial(info.encode, text, add_special_tokens=False, param="prediction")
        )

    model, scale = adapter_choice(ctx.engine, body.model, body.lora, body.lora_scale)

    def generation_of(setup: ChatSetup, params: SamplingParams) -> GenerationRequest:
        return GenerationRequest(
            model, setup.prompt_ids, params, keep_special=setup.keep_special, images=images,
            prediction=prediction or None, speculative=body.speculative, adapter_scale=scale,
        )

    meta = ResponseMeta(f"chatcmpl-{uuid.uuid4().hex}", body.model)
    formatter = LogprobFormatter(info.tokenizer, params.logprobs) if params.logprobs is not None else None
    reasons = info.reasoning_parser is not None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reasoning = ReasoningCount(functools.partial(info.tokenizer.encode, add_special_tokens=False)) if reasons else None
    if mcp is not None:
        loop = McpChat(ctx, request, mcp[0], mcp[1], prepare, params, generation_of, effort=body.reasoning_effort)
        shown = McpChatChunks(meta, include_usage, logprobs=formatter, predicted=body.prediction is not None,
                              reasoning=reasoning)  # fmt: skip
        reply = await mcp_chat_completion(loop, meta, body.stream, shown, reasoning.encode if reasoning else None)
        return reply if body.stream else json_response(reply)
    setup = await prepare_in_thread(ctx, request, prepare)
    params.constraint = setup.constraint or params.constraint
    limit_thinking(params, setup, effort=body.reasoning_effort)
    handles = submit_choices(ctx, generation_of(setup, params), body.n)
    if body.stream:
        chunks = [
            ChatChunks(meta, include_usage, reader=setup.reader(), index=i, logprobs=formatter,
                       predicted=body.prediction is not None, reasoning=reasoning)
            for i in range(len(handles))
        ]
        return sse_response(ctx, handles, chunks)
    replies = await collect_choices(ctx, handles, request)
    choices, reasoning_tokens = [], 0
    for i, reply in enumerate(replies):
        reader = setup.reader()
        message, _ = assistant_message(reader, reply.text)
        if isinstance(message.reasoning_content, str):
            reasoning_tokens += len(info.tokenizer.encode(message.reasoning_content, add_special_tokens=False))
        logprobs = formatter.chat(reply.logprobs) if formatter is not None else None
        choices.append(s.ChatChoice(i, message, reader.finish_reason(reply.finished.reason), logprobs))
    usage = usage_of(total_usage([reply.finished.usage for reply in replies]), predicted=body.prediction is not None,
                     reasoning_tokens=reasoning_tokens if reasons else None)  # fmt: skip
    return json_response(s.ChatCompletion(meta.id, meta.created, meta.model, choices, usage))


async def create_completion(
    ctx: ServerContext, body: s.CompletionRequest, request: Request[Any, Any, Any]
) -> Response[Any]:
    """``POST /v1/completions``."""
    _refuse_unsupported_completion(body)
    prompt = completion_prompt(body.prompt)
    params = request_params(body, ctx, max_tokens=body.max_tokens)
    params.logprobs = body.logprobs
    engine = ready_engine(ctx)
    info = await loaded_model(ctx, body.model)
    if isinstance(prompt, str):
        prompt_ids = await prepare_in_thread(ctx, request, functools.partial(engine.encode, body.model, prompt))
    else:
        vocab = info.tokenizer.vocab_size
        if any(not 0 <= token < vocab for token in prompt):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", field="prompt")
        prompt_ids = prompt
    try:
        model, scale = adapter_choice(engine, body.model, body.lora, body.lora_scale)
        generation = GenerationRequest(model=model, prompt_ids=prompt_ids, params=params, speculative=body.speculative,
                                       adapter_scale=scale)  # fmt: skip
        handles = submit_choices(ctx, generation, body.n)
    except ContextLengthExceeded as exc:
        exc.field = "prompt"
        raise
    meta = ResponseMeta(f"cmpl-{uuid.uuid4().hex}", body.model)
    formatter = LogprobFormatter(info.tokenizer, params.logprobs) if params.logprobs is not None else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = [CompletionChunks(meta, include_usage, index=i, logprobs=formatter) for i in range(len(handles))]
        return sse_response(ctx, handles, chunks)
    replies = await collect_choices(ctx, handles, request)
    choices = [
        s.CompletionChoice(
            i, reply.text, reply.finished.reason,
            formatter.completion(reply.logprobs) if formatter is not None else None,
        )
        for i, reply in enumerate(replies)
    ]
    usage = usage_of(total_usage([reply.finished.usage for reply in replies]))
    return json_response(s.Completion(meta.id, meta.created, meta.model, choices, usage=usage))


def submit_choices(ctx: ServerContext, request: GenerationRequest, n: int | None) -> list[RequestHandle]:
    """Submit ``n`` generations of ``request`` (choice ``i`` seeded ``seed + i`` when a seed is
    given, so each choice differs and the whole is reproducible); if one is refused (a full
    queue), the ones already submitted are cancelled and the refusal propagates."""
    handles: list[RequestHandle] = []
    try:
        for i in range(n or 1):
            params = request.params
            if i:
                seed = None if params.seed is None else (params.seed + i) % 2**64
                params = attrs.evolve(params, seed=seed)
            handles.append(submit(ctx, attrs.evolve(request, params=params)))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def collect_choices(
    ctx: ServerContext, handles: list[RequestHandle], request: Request[Any, Any, Any]
) -> list[Reply]:
    """Every choice's whole reply; if one fails, the others are cancelled and its error raised."""
    if len(handles) == 1:
        return [await collect(ctx, handles[0], request)]
    try:
        return list(await asyncio.gather(*(collect(ctx, handle, request) for handle in handles)))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise


# -- request -> engine -----------------------------------------------------------------------


def chat_messages(messages: list[s.ChatMessage], images: list[ImageInput] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages as the plain dicts a chat template renders. ``image_url`` parts become
    ``{"type": "image"}`` parts (Hugging Face's form) with their data appended to ``images``;
    without ``images`` they are refused."""
    if not messages:
        raise RequestError("messages must hold at least one message", field="messages")
    rendered = []
    for i, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise RequestError(
                f"unsupported role {message.role!r}; expected one of {', '.join(ROLES)}",
                field=f"messages[{i}].role",
            )
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts, parts = [], []
            for j, part in enumerate(content):
                if part.type == "image_url" and part.image_url is not None and images is not None:
                    images.append(ImageInput.from_url(part.image_url.url, f"messages[{i}].content[{j}].image_url"))
                    parts.append({"type": "image"})
                    continue
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"content parts of type {part.type!r} are not supported; send text or image_url parts",
                        field=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
                parts.append({"type": "text", "text": part.text})
            text = "\n".join(texts)
        has_image = isinstance(content, list) and len(texts) < len(content)
        rendered.append(message_dict(message, {"role": role, "content": parts if has_image else text}))
    return rendered


def completion_prompt(prompt: str | list[Any]) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if prompt and all(is_token(token) for token in prompt):
        return [int(token) for token in prompt]
    if len(prompt) > 1 and all(isinstance(item, (str, list)) for item in prompt):
        raise RequestError("batched prompts are not supported; send one prompt per request", field="prompt")
    raise RequestError(
        "prompt must be a string, a list of one string, or a list of token ids", field="prompt"
    )


def request_params(body: s.Request, ctx: ServerContext, *, max_tokens: int | None) -> SamplingParams:
    """The request's sampling fields (:func:`~mlxr_core.http.requests.sampling_params`) and its
    one constraint: ``response_format`` or a grammar field (:func:`request_constraint`)."""
    return sampling_params(
        ctx,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=logit_bias(body.logit_bias),
        constraint=request_constraint(ctx, body, response_constraint(body.response_format)),
        extra=_extra_params(body, ctx),
    )


def prediction_text(prediction: s.Prediction) -> str:
    """The text of a chat completion's ``prediction`` (a string, or text parts joined)."""
    if isinstance(prediction.content, str):
        return prediction.content
    return "".join(part.text for part in prediction.content)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer keys; the sampler
    plugin checks the ids against the model's vocabulary and the values' range."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not re.search(s.TOKEN_KEY, key):
            raise RequestError(f"logit_bias keys must be token ids, got {key[:32]!r}", field="logit_bias")
        parsed[int(key)] = value
    return parsed


def response_constraint(response_format: s.ResponseFormat | None) -> Constraint | None:
    """``response_format`` as the constraint a sampler plugin enforces while decoding."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Constraint(kind="json_object", field="response_format")
    if response_format.json_schema is None or response_format.json_schema.schema is None:
        raise RequestError(
            "response_format of type 'json_schema' needs json_schema.schema", field="response_format"
        )
    return Constraint(kind="json_schema", value=response_format.json_schema.schema, field="response_format")


def _extra_params(body: s.Request, ctx: ServerContext) -> dict[str, Any]:
    return {"ignore_eos": True} if body.ignore_eos else {}


def _refuse_unsupported_completion(body: s.CompletionRequest) -> None:
    if body.echo:
        raise RequestError("echo is not supported by this server", field="echo")
    if body.suffix:
        raise RequestError("suffix is not supported by this server", field="suffix")
    if body.best_of is not None and body.best_of != 1:
        raise RequestError(f"only best_of=1 is supported, got {body.best_of}", field="best_of")


def _card(engine: EngineClient, name: str) -> s.ModelCard:
    """The served model ``name`` and what it takes; one never loaded yet (``load: lazy``) is known
    by name only. A LoRA adapter served as a model names its model as ``parent``."""
    adapter = engine.adapters.get(name)
    if adapter is not None:
        parent = engine.models.get(adapter[0])
        created = parent.created if parent is not None else int(engine.started_at)
        context = parent.context_length if parent is not None else None
        capabilities = parent.capabilities if parent is not None else UNSET
        return s.ModelCard(
            id=name, created=created, context_length=context, parent=adapter[0], capabilities=capabilities
        )
    info = engine.models.get(name)
    if info is None:
        return s.ModelCard(id=name, created=int(engine.started_at))
    return s.ModelCard(
        id=info.name, created=info.created, context_length=info.context_length, capabilities=info.capabilities
    )
