"""The Anthropic-compatible routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A handler decodes its body strictly (:func:`mlxr_core.frontend.decode_body`), renders the
conversation with the model's chat template (``system`` first; consecutive turns of one role
merged, as Anthropic does; a final assistant turn is a prefill the reply continues), submits to
the engine and answers with one message or a stream of events
(:mod:`mlxr_plugins.apis.anthropic.streaming`).

``max_tokens`` is an upper bound, as in Anthropic's API: it is lowered to the room the context
leaves after the prompt (and to ``server.max_tokens_cap``), and the reply says ``max_tokens`` when it
is reached. Tools, thinking and non-text content blocks are refused with a 400 naming the field.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import anyio
from litestar import Request, Response, Router, post

from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import GenerationRequest, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.frontend import cap_max_tokens, collect, decode_body, ready_engine, room_for, submit
from mlxr_core.openapi import documented
from mlxr_core.server import ServerContext
from mlxr_plugins.apis.anthropic import schemas as s
from mlxr_plugins.apis.anthropic.errors import EXCEPTION_HANDLERS
from mlxr_plugins.apis.anthropic.streaming import MessageMeta, message, sse_response

ROLES = ("user", "assistant")
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 256


def make_router(ctx: ServerContext) -> Router:
    """The Anthropic Messages API as a Litestar router (the ``anthropic`` entry of ``apis:``)."""

    @post("/messages", status_code=200, operation_class=documented(
        request=s.MessagesRequest, response=s.MessageResponse, error=s.ErrorBody,
        stream="text/event-stream"))
    async def messages(request: Request[Any, Any, Any]) -> Response[Any]:
        return await create_message(ctx, request)

    @post("/messages/count_tokens", status_code=200, operation_class=documented(
        request=s.CountTokensRequest, response=s.CountTokensResponse, error=s.ErrorBody))
    async def count_tokens(request: Request[Any, Any, Any]) -> Response[Any]:
        body = decode_body(await request.body(), s.CountTokensRequest)
        _refuse_unsupported(body)
        engine = ready_engine(ctx)
        engine.model(body.model)
        ids = await anyio.to_thread.run_sync(functools.partial(prompt_ids, engine, body))
        return _json(s.CountTokensResponse(len(ids)))

    return Router(
        path="/v1",
        route_handlers=[messages, count_tokens],
        exception_handlers=EXCEPTION_HANDLERS,
        tags=["anthropic"],
    )


async def create_message(ctx: ServerContext, request: Request[Any, Any, Any]) -> Response[Any]:
    """``POST /v1/messages``."""
    body = decode_body(await request.body(), s.MessagesRequest)
    _refuse_unsupported(body)
    params = sampling_params(ctx, body)
    engine = ready_engine(ctx)
    engine.model(body.model)  # an unknown model is a 404 before any templating
    ids = await anyio.to_thread.run_sync(functools.partial(prompt_ids, engine, body))
    params.max_tokens = cap_max_tokens(ctx, room_for(engine, body.model, ids, body.max_tokens))
    handle = submit(ctx, GenerationRequest(model=body.model, prompt_ids=ids, params=params))
    meta = MessageMeta(f"msg_{uuid.uuid4().hex}", body.model, len(ids))
    if body.stream:
        return sse_response(ctx, handle, meta)
    reply = await collect(ctx, handle, request)
    return _json(message(meta, reply.text, reply.finished))


# -- request -> engine -----------------------------------------------------------------------


def sampling_params(ctx: ServerContext, body: s.MessagesRequest) -> SamplingParams:
    """Anthropic's sampling fields over the config's ``sampling:`` defaults."""
    defaults = ctx.config.sampling
    stops = list(body.stop_sequences or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop_sequences")
    if any(not stop or len(stop) > MAX_STOP_CHARS for stop in stops):
        raise RequestError(
            f"stop sequences must be non-empty and at most {MAX_STOP_CHARS} characters", param="stop_sequences"
        )
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p,
        stop=stops,
    )


def prompt_ids(engine: Engine, body: s.CountTokensRequest) -> list[int]:
    """The conversation rendered with the model's chat template and tokenized."""
    messages = chat_messages(body)
    if messages[-1]["role"] != "assistant":
        return engine.encode_chat(body.model, messages)
    # A prefill: the reply continues the final assistant turn, which the template must not close.
    tokenizer = engine.model(body.model).tokenizer
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
    ids = tokenizer.encode(prompt + messages[-1]["content"], add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)  # as Engine.encode_chat does
    return ids


def chat_messages(body: s.CountTokensRequest) -> list[dict[str, Any]]:
    """``system`` then the turns, as dicts a chat template renders; same-role turns merged."""
    if not body.messages:
        raise RequestError("messages: at least one message is required", param="messages")
    rendered: list[dict[str, Any]] = []
    if body.system:
        rendered.append({"role": "system", "content": _text(body.system, "system")})
    for i, turn in enumerate(body.messages):
        if turn.role not in ROLES:
            raise RequestError(
                f"unexpected role {turn.role!r}; expected one of {', '.join(ROLES)} "
                "(send the system prompt as the top-level system field)",
                param=f"messages[{i}].role",
            )
        text = _text(turn.content, f"messages[{i}].content")
        if rendered and rendered[-1]["role"] == turn.role:
            rendered[-1]["content"] += "\n\n" + text
        else:
            rendered.append({"role": turn.role, "content": text})
    return rendered


def _text(content: str | list[s.ContentBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise RequestError(
                f"content blocks of type {block.type!r} are not supported; send text blocks",
                param=f"{param}[{j}]",
            )
        texts.append(block.text)
    return "\n\n".join(texts)


def _refuse_unsupported(body: s.CountTokensRequest) -> None:
    if body.tools:
        raise RequestError("tools are not supported by this server", param="tools")
    if body.thinking is not None and body.thinking.type != "disabled":
        raise RequestError("extended thinking is not supported by this server", param="thinking")


def _json(value: Any) -> Response[bytes]:
    return Response(s.encoder.encode(value), media_type="application/json")
