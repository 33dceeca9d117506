"""The Anthropic-compatible routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A handler takes its body typed (decoded strictly by :class:`mlxr_core.http.frontend.JsonRequest`), renders the
conversation with the model's chat template (``system`` first; consecutive turns of one role
merged, as Anthropic does; a final assistant turn is a prefill the reply continues), submits to
the engine and answers with one message or a stream of events
(:mod:`mlxr_plugins.apis.anthropic.streaming`).

``max_tokens`` is an upper bound, as in Anthropic's API: it is lowered to the room the context
leaves after the prompt (and to ``server.max_tokens_cap``), and the reply says ``max_tokens`` when it
is reached.

Tools: client tools (``tools`` with an ``input_schema``) are offered to the model through its chat
template or its tool parser (:mod:`mlxr_core.chat.tools`); its calls come back as ``tool_use``
blocks (``stop_reason: "tool_use"``), ``tool_choice`` ``any``/``tool`` force a call (the output is
constrained to one), and ``tool_result`` blocks feed the answers back. Thinking: text inside the
model's reasoning markers comes back as ``thinking`` blocks, never inside ``text``. Image and
document blocks and Anthropic's server tools are refused with a 400 naming the field.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import msgspec
from litestar import Request, Response, Router, post
from litestar.params import JSONBody

from mlxr_core.chat.parsing import Tool
from mlxr_core.chat.thinking import limit_thinking
from mlxr_core.chat.tools import ChatSetup, ToolChoice, model_parsers, prepare_chat
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.client import EngineClient
from mlxr_core.engine.request import GenerationRequest, PromptImage
from mlxr_core.errors import RequestError
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
from mlxr_plugins.apis.anthropic import schemas as s
from mlxr_plugins.apis.anthropic.errors import EXCEPTION_HANDLERS
from mlxr_plugins.apis.anthropic.streaming import MessageMeta, message, sse_response

ROLES = ("user", "assistant")


def make_router(ctx: ServerContext) -> Router:
    """The Anthropic Messages API as a Litestar router (the ``anthropic`` entry of ``apis:``)."""

    @post("/messages", status_code=200, operation_class=documented(
        error=s.ErrorBody, response=s.MessageResponse, stream=Stream("text/event-stream", (s.StreamEvent,))))
    async def messages(data: JSONBody[s.MessagesRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return await create_message(ctx, data, request)

    @post("/messages/count_tokens", status_code=200, operation_class=documented(error=s.ErrorBody))
    async def count_tokens(data: JSONBody[s.CountTokensRequest], request: Request[Any, Any, Any]) -> s.CountTokensResponse:
        engine = ready_engine(ctx)
        info = await loaded_model(ctx, data.model)
        setup, _ = await prepare(ctx, request, engine, info, data)
        return s.CountTokensResponse(len(setup.prompt_ids))

    return Router(
        path="/v1",
        route_handlers=[messages, count_tokens],
        exception_handlers=EXCEPTION_HANDLERS,
        tags=["anthropic"],
    )


async def create_message(ctx: ServerContext, body: s.MessagesRequest, request: Request[Any, Any, Any]) -> Response[Any]:
    """``POST /v1/messages``."""
    params = sampling_params(
        ctx,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences,
        stop_param="stop_sequences",
    )
    engine = ready_engine(ctx)
    info = await loaded_model(ctx, body.model)  # an unknown model is a 404 before any templating
    setup, images = await prepare(ctx, request, engine, info, body)
    params.max_tokens = cap_max_tokens(ctx, room_for(engine, body.model, setup.prompt_ids, body.max_tokens))
    params.constraint = setup.constraint
    if body.thinking is not None and body.thinking.type == "enabled":
        limit_thinking(params, setup, tokens=body.thinking.budget_tokens)
    handle = submit(ctx, GenerationRequest(
        model=body.model, prompt_ids=setup.prompt_ids, params=params, keep_special=setup.keep_special,
        images=images,
    ))
    meta = MessageMeta(f"msg_{uuid.uuid4().hex}", body.model, len(setup.prompt_ids), has_breakpoints(body))
    if body.stream:
        return sse_response(ctx, handle, meta, setup.reader())
    reply = await collect(ctx, handle, request)
    return json_response(message(meta, setup.reader(), reply.text, reply.finished))


# -- request -> engine -----------------------------------------------------------------------


async def prepare(
    ctx: ServerContext, request: Request[Any, Any, Any], engine: EngineClient, info: ModelInfo, body: s.CountTokensRequest
) -> tuple[ChatSetup, list[PromptImage]]:
    """The conversation, with its tools, rendered with the model's chat template and tokenized
    (in a worker thread), and its ``image`` blocks loaded (decoded and preprocessed under the
    server's limits: an image's tokens are counted from its size). A final assistant turn of
    text is a prefill the reply continues."""
    _check_thinking(body)
    inputs: list[ImageInput] = []
    messages = chat_messages(body, inputs)
    images = await load_images(ctx.config.server, info, inputs)
    prefill = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"]
        if not messages:
            raise RequestError("messages: the conversation must start with a user turn", field="messages")
    tools, choice, parallel = tool_request(body)
    thinking = None if body.thinking is None else body.thinking.type == "enabled"
    variables = template_variables(body.chat_template_kwargs, thinking=thinking)
    render = functools.partial(
        prepare_chat, info, model_parsers(ctx, info), messages,
        tools=tools, choice=choice, parallel=parallel, prefill=prefill, template_kwargs=variables, images=images,
    )  # fmt: skip
    return await prepare_in_thread(ctx, request, render), images


def has_breakpoints(body: s.CountTokensRequest) -> bool:
    """Whether any system block, tool, message block or tool result's block marks ``cache_control``."""
    blocks: list[Any] = list(body.system) if isinstance(body.system, list) else []
    blocks += body.tools or []
    for turn in body.messages:
        if isinstance(turn.content, list):
            blocks += turn.content
            blocks += [part for block in turn.content if isinstance(block.content, list) for part in block.content]
    return any((block.get("cache_control") if isinstance(block, dict) else getattr(block, "cache_control", None))
               for block in blocks)  # fmt: skip


def tool_request(body: s.CountTokensRequest) -> tuple[list[Tool], ToolChoice, bool]:
    """The request's client tools, its tool choice and whether several calls may be made."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise RequestError(
                f"server tools ({tool.type!r}) are not run by this server; define client tools "
                "with an input_schema",
                field=f"tools[{i}].type",
            )
        schema = tool.input_schema or {"type": "object", "properties": {}}
        tools.append(Tool(tool.name, tool.description or "", schema))
    choice = body.tool_choice
    if choice is None:
        return tools, ToolChoice("auto" if tools else "none"), True
    if choice.type == "tool" and not choice.name:
        raise RequestError("tool_choice of type 'tool' needs a name", field="tool_choice.name")
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[choice.type]
    return tools, ToolChoice(mode, choice.name if mode == "function" else None), not choice.disable_parallel_tool_use


def chat_messages(body: s.CountTokensRequest, images: list[ImageInput] | None = None) -> list[dict[str, Any]]:
    """``system`` then the turns, as the dicts :func:`~mlxr_core.chat.tools.prepare_chat` takes:
    same-role text turns merged, ``tool_use`` blocks as the assistant's ``tool_calls``,
    ``tool_result`` blocks as ``tool`` turns (before the user's text in the same turn), a user
    turn with ``image`` blocks as text and ``{"type": "image"}`` parts in their order (Hugging
    Face's form), the images' data appended to ``images``."""
    images = [] if images is None else images
    if not body.messages:
        raise RequestError("messages: at least one message is required", field="messages")
    rendered: list[dict[str, Any]] = []
    if body.system:
        rendered.append({"role": "system", "content": _text(body.system, "system")})
    for i, turn in enumerate(body.messages):
        if turn.role not in ROLES:
            raise RequestError(
                f"unexpected role {turn.role!r}; expected one of {', '.join(ROLES)} "
                "(send the system prompt as the top-level system field)",
                field=f"messages[{i}].role",
            )
        before = len(images)
        text, calls, results, parts = _blocks(turn.role, turn.content, f"messages[{i}].content", images)
        rendered.extend(results)
        if not text and not calls and results and len(images) == before:
            continue
        last = rendered[-1] if rendered else None
        merge = last is not None and last["role"] == turn.role and not last.get("tool_calls") and not calls
        if merge and parts is None and isinstance(last["content"], str):  # type: ignore[index]
            last["content"] += "\n\n" + text  # type: ignore[index]
            continue
        entry: dict[str, Any] = {"role": turn.role, "content": text if parts is None else parts}
        if calls:
            entry["tool_calls"] = calls
        rendered.append(entry)
    return rendered


def _blocks(
    role: str, content: str | list[s.ContentBlock], param: str, images: list[ImageInput]
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A turn's text, the calls it makes (assistant), the results it carries (user), and, for a
    turn with images, its text and image parts in order (None without)."""
    if isinstance(content, str):
        return content, [], [], None
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and role == "user":
            images.append(_image(block.source, f"{where}.source"))
            parts.append({"type": "image"})
        elif block.type == "tool_use" and role == "assistant" and block.id and block.name:
            arguments = block.input if isinstance(block.input, dict) else {}
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type == "tool_result" and role == "user" and block.tool_use_id:
            output = _result_text(block.content, where, images, parts)
            if block.is_error:
                output = f"Error: {output}"
            results.append({"role": "tool", "content": output, "tool_call_id": block.tool_use_id})
        elif block.type in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise RequestError(
                f"content blocks of type {block.type!r} are not supported here; send text, "
                "image (user), tool_use (assistant) or tool_result (user) blocks",
                field=where,
            )
    with_images = any(part["type"] == "image" for part in parts)
    return "\n\n".join(texts), calls, results, parts if with_images else None


def _image(source: s.ImageSource | None, field: str) -> ImageInput:
    """An ``image`` block's source: base64 data, or a URL (fetched only when server.allow_remote_images is on)."""
    if source is not None and source.type == "base64" and source.data is not None:
        return ImageInput(source.data, field)
    if source is not None and source.type == "url" and source.url is not None:
        return ImageInput(source.url, field, url=True)
    raise RequestError("an image block needs a base64 source (type, media_type, data) or a url", field=field)


def _result_text(
    content: str | list[Any] | None, param: str, images: list[ImageInput], parts: list[dict[str, Any]]
) -> str:
    """A tool result's text; its ``image`` blocks (Anthropic allows them) are appended to
    ``images`` and shown in the user turn that carries the result, as ``parts``."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, item in enumerate(content):
        where = f"{param}.content[{k}]"
        if isinstance(item, dict) and item.get("type") == "image":
            try:
                source = msgspec.convert(item.get("source"), s.ImageSource)
            except msgspec.ValidationError:
                source = None  # _image says what a source needs
            images.append(_image(source, f"{where}.source"))
            parts.append({"type": "image"})
            continue
        if not isinstance(item, dict) or item.get("type") != "text" or not isinstance(item.get("text"), str):
            raise RequestError("tool_result content must be text or image blocks", field=where)
        texts.append(item["text"])
    return "\n\n".join(texts)


def _text(content: str | list[s.ContentBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise RequestError(
                f"content blocks of type {block.type!r} are not supported; send text blocks",
                field=f"{param}[{j}]",
            )
        texts.append(block.text)
    return "\n\n".join(texts)


def _check_thinking(body: s.CountTokensRequest) -> None:
    """``thinking`` ``enabled`` or ``disabled``; a model with a reasoning parser returns its
    thinking as ``thinking`` blocks either way (a model that does not think returns none)."""
    if body.thinking is not None and body.thinking.type not in ("enabled", "disabled"):
        raise RequestError(
            f"thinking.type must be 'enabled' or 'disabled', got {body.thinking.type!r}", field="thinking.type"
        )
