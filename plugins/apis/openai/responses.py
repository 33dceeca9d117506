"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed), ``GET`` and ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A request's ``input`` (text, messages with text and ``input_image`` parts, earlier
``function_call`` / ``function_call_output`` and ``reasoning`` items), after the stored
conversation ``previous_response_id`` names and under its own ``instructions``, becomes the chat a
model's template renders, exactly as a chat completion's messages do (images loaded by
:mod:`mlxr_core.http.images`, a stored turn's again for a follow-up); the reply is read by the same
parsers (reasoning, tool calls) and told as output items: ``reasoning``, ``message`` and
``function_call``. Streamed, it is the event sequence ``response.created``,
``response.in_progress``, per item ``output_item.added``, its deltas and ``output_item.done``, then
``response.completed`` (or ``incomplete`` / ``failed``), each numbered. With ``background``
the response runs on after the request is answered (:mod:`mlxr_plugins.apis.openai.background`):
polled with ``GET``, cancelled with ``POST /v1/responses/{id}/cancel``, its events streamed again
from any number with ``GET ...?stream=true&starting_after=N``.
With ``store`` (the default) the response, its input items and the conversation are kept in a
bounded SQLite store (:mod:`mlxr_plugins.apis.openai.store`), each response for the API key that
made it alone: to any other key (retrieve, ``input_items``, ``previous_response_id``, delete) it
is a 404, as if it did not exist.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import attrs
import msgspec
from litestar import Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream

from mlxr_core.chat.parsing import Text, Tool, ToolCall
from mlxr_core.chat.thinking import limit_thinking
from mlxr_core.chat.tools import (
    ChatSetup,
    ReplyReader,
    ToolChoice,
    constraints_supported,
    model_parsers,
    prepare_chat,
)
from mlxr_core.engine.request import (
    Constraint,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestHandle,
)
from mlxr_core.engine.request import Usage as EngineUsage
from mlxr_core.errors import MlxrError, RequestCancelled, RequestError
from mlxr_core.http.access import key_owner
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    collect,
    json_response,
    loaded_model,
    prepare_in_thread,
    ready_engine,
    shutdown_cancelled,
    submit,
    tracked_events,
)
from mlxr_core.http.images import ImageInput, load_images
from mlxr_core.http.openapi import Stream as EventStream
from mlxr_core.http.openapi import documented
from mlxr_core.http.requests import sampling_params, template_variables
from mlxr_core.model.paths import data_dir
from mlxr_plugins.apis.openai import responses_schemas as r
from mlxr_plugins.apis.openai.background import BackgroundRuns, Run
from mlxr_plugins.apis.openai.compact import (
    CompactionSeal,
    compact,
    compaction_seal,
    summary_message,
)
from mlxr_plugins.apis.openai.errors import error_body
from mlxr_plugins.apis.openai.mcp_tools import (
    McpTools,
    answer_approvals,
    check_choice,
    open_tools,
    run_turns,
)
from mlxr_plugins.apis.openai.schemas import ErrorBody
from mlxr_plugins.apis.openai.store import ResponseStore, Stored
from mlxr_plugins.apis.openai.streaming import SSE_HEADERS
from mlxr_plugins.apis.openai.tools import choice_mode

#: Input roles a template may see; ``developer`` is OpenAI's new name for ``system``.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: Content parts that are text.
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseNotFound(RequestError):
    status = 404

    def __init__(self, response_id: str, param: str | None = None):
        super().__init__(f"no stored response with id {response_id[:64]!r}", field=param)


# -- input -> chat -------------------------------------------------------------------------------


def _text_of(content: str | list[r.ContentPart] | None, param: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise RequestError(f"content parts of type {part.type!r} are not supported; send text", field=f"{param}[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def _message_content(
    content: str | list[r.ContentPart] | None, param: str, images: list[ImageInput]
) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    """A message's content for the template: text, or with images Hugging Face's parts (text and
    ``{"type": "image", "image_url": ...}`` in order, each image's data appended to ``images``)
    with the parts a stored input item lists (none for text)."""
    if not isinstance(content, list) or not any(part.type == "input_image" for part in content):
        return _text_of(content, param), []
    parts: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type != "input_image":
            if part.type not in TEXT_PARTS or part.text is None:
                raise RequestError(f"content parts of type {part.type!r} are not supported; send text or input_image",
                                   field=f"{param}[{j}]")  # fmt: skip
            parts.append({"type": "text", "text": part.text})
            listed.append({"type": "input_text", "text": part.text})
        elif part.image_url is None:
            raise RequestError("an input_image part needs image_url (a data URI or a URL); file_id is not supported",
                               field=f"{param}[{j}]")  # fmt: skip
        else:
            images.append(ImageInput.from_url(part.image_url, f"{param}[{j}].image_url"))
            parts.append({"type": "image", "image_url": part.image_url})
            listed.append({"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"})
    return parts, listed


def _history_images(messages: list[dict[str, Any]]) -> list[ImageInput]:
    """The images of a stored conversation's turns, loaded again for the follow-up."""
    return [ImageInput.from_url(part["image_url"], "previous_response_id")
            for message in messages if isinstance(message["content"], list)
            for part in message["content"] if part.get("type") == "image"]  # fmt: skip


def _without_image_data(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat as the template sees it: image parts as plain ``{"type": "image"}``."""
    return [{**message, "content": [{"type": "image"} if part.get("type") == "image" else part for part in message["content"]]}
            if isinstance(message["content"], list) else message for message in messages]  # fmt: skip


def input_messages(
    items: str | list[r.InputItem], images: list[ImageInput], seal: CompactionSeal
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``input`` as chat messages, and as the input items a stored response lists; ``input_image``
    parts' data is appended to ``images``; a compaction item must carry ``seal``'s signature."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [_message_item("user", items)]
    if not items:
        raise RequestError("input must hold at least one item", field="input")
    messages: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if item.type == "message":
            role = ROLES.get(item.role or "")
            if role is None:
                raise RequestError(f"unsupported role {item.role!r}; expected one of {', '.join(ROLES)}", field=f"{param}.role")
            content, parts = _message_content(item.content, f"{param}.content", images)
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
            listed.append(_message_item(item.role or role, content) if isinstance(content, str)
                          else {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": item.role or role, "content": parts})  # fmt: skip
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise RequestError("a function_call item needs call_id and name", field=param)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
            names[item.call_id] = item.name
            listed.append({"type": "function_call", "id": item.id or f"fc_{item.call_id}", "call_id": item.call_id,
                           "name": item.name, "arguments": item.arguments or "{}", "status": "completed"})  # fmt: skip
        elif item.type == "function_call_output":
            if not item.call_id:
                raise RequestError("a function_call_output item needs call_id", field=param)
            output = _text_of(item.output, f"{param}.output")
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": item.call_id, "content": output}
            if item.call_id in names:
                tool["name"] = names[item.call_id]
            messages.append(tool)
            listed.append({"type": "function_call_output", "id": item.id or f"fco_{item.call_id}",
                           "call_id": item.call_id, "output": output})  # fmt: skip
        elif item.type == "reasoning":
            reasoning += _text_of(item.content, f"{param}.content") or _text_of(item.summary, f"{param}.summary")
        elif item.type == "mcp_approval_response":  # answered by mcp_tools.answer_approvals
            listed.append({"type": "mcp_approval_response", "id": item.id or f"mcpa_{uuid.uuid4().hex}",
                           "approval_request_id": item.approval_request_id, "approve": item.approve})  # fmt: skip
        elif item.type == "compaction":
            summary = seal.decode(item.encrypted_content, f"{param}.encrypted_content")
            messages.append(summary_message(summary))
            listed.append({"type": "compaction", "id": item.id or f"cmp_{uuid.uuid4().hex}",
                           "encrypted_content": item.encrypted_content})  # fmt: skip
        else:
            raise RequestError(f"input items of type {item.type!r} are not supported", field=f"{param}.type")
    return messages, listed


def _message_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": role, "content": [{"type": kind, "text": text}]}


def tool_request(body: r.ResponsesRequest) -> tuple[list[Tool], ToolChoice, bool]:
    """Function tools, the tool choice, and whether several calls may be made at once."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type == "mcp":
            continue  # the server's to run (mcp_tools)
        if tool.type != "function":
            raise RequestError(f"tools of type {tool.type!r} are not supported; send function tools", field=f"tools[{i}].type")
        if not tool.name:
            raise RequestError("a function tool needs a name", field=f"tools[{i}].name")
        tools.append(Tool(tool.name, tool.description or "", tool.parameters or {"type": "object", "properties": {}}))
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        mode = choice_mode(choice, tools)
    elif choice.type in ("function", "mcp") and choice.name:
        mode = ToolChoice("function", choice.name)  # an MCP tool's server is checked by check_choice
    else:
        raise RequestError("tool_choice must name a function: {'type': 'function', 'name': ...} (or an MCP "
                           "server's tool: {'type': 'mcp', 'server_label': ..., 'name': ...})", field="tool_choice")  # fmt: skip
    return tools, mode, body.parallel_tool_calls is not False


def text_constraint(ctx: ServerContext, text: r.TextConfig | None) -> Constraint | None:
    """``text.format`` as the constraint a sampler plugin enforces."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if not constraints_supported(ctx):
        raise RequestError(f"text.format {fmt.type!r} needs a sampler plugin that enforces structured output", field="text.format")
    if fmt.type == "json_object":
        return Constraint("json_object")
    if fmt.schema is None:
        raise RequestError("text.format of type 'json_schema' needs schema", field="text.format.schema")
    return Constraint("json_schema", fmt.schema)


# -- reply -> output items -----------------------------------------------------------------------


class OutputBuilder:
    """A reply's pieces as output items, and the stream events that tell them as they come."""

    def __init__(self, response: r.Response, sink: Callable[[int, bytes], None] | None = None):
        self.response = response
        self.items: list[r.OutputItem] = response.output
        self.sequence = 0
        #: Told every event with its number as it is made (a background run's record).
        self.sink = sink
        self._open: r.MessageItem | r.ReasoningItem | None = None
        self._pending = ""  # blanks before any text of a message: dropped if no text follows

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        encoded = b"event: " + kind.encode() + b"\ndata: " + r.encoder.encode(data) + b"\n\n"
        if self.sink is not None:
            self.sink(self.sequence, encoded)
        self.sequence += 1
        return encoded

    def feed(self, pieces: Sequence[Text | ToolCall]) -> bytes:
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(self._close())
                out.append(self._call(piece))
            elif piece.kind == "reasoning" and piece.text:
                out.append(self._text(piece.text, r.ReasoningItem))
            elif piece.kind == "content" and piece.text:
                if not isinstance(self._open, r.MessageItem) and not piece.text.strip():
                    self._pending += piece.text
                    continue
                out.append(self._text(self._pending + piece.text, r.MessageItem))
                self._pending = ""
        return b"".join(out)

    def finish(self) -> bytes:
        self._pending = ""
        return self._close()

    def _text(self, text: str, kind: type[r.MessageItem] | type[r.ReasoningItem]) -> bytes:
        out = b""
        if not isinstance(self._open, kind):
            out = self._close()
            if kind is r.MessageItem:
                self._open = r.MessageItem(f"msg_{uuid.uuid4().hex}", [])
            else:
                self._open = r.ReasoningItem(f"rs_{uuid.uuid4().hex}", [])
            index = len(self.items)
            self.items.append(self._open)
            out += self.event("response.output_item.added", output_index=index, item=self._open)
            if isinstance(self._open, r.MessageItem):
                self._open.content.append(r.OutputText(""))
                out += self.event("response.content_part.added", item_id=self._open.id, output_index=index,
                                  content_index=0, part=r.OutputText(""))  # fmt: skip
            else:
                self._open.content.append(r.ReasoningText(""))
        index, item = len(self.items) - 1, self._open
        item.content[0].text += text
        delta = "response.output_text.delta" if isinstance(item, r.MessageItem) else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if isinstance(item, r.MessageItem) else {}
        return out + self.event(delta, item_id=item.id, output_index=index, content_index=0, delta=text, **extra)

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        index, part = self.items.index(item), item.content[0]
        if isinstance(item, r.MessageItem):
            out = self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                             text=part.text, logprobs=[])  # fmt: skip
            out += self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
        else:
            out = self.event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0, text=part.text)
        return out + self.event("response.output_item.done", output_index=index, item=item)

    def _call(self, call: ToolCall) -> bytes:
        item = r.FunctionCallItem(f"fc_{uuid.uuid4().hex}", call.id, call.name, "")
        index = len(self.items)
        self.items.append(item)
        out = self.event("response.output_item.added", output_index=index, item=item)
        item.arguments = call.arguments
        out += self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=call.arguments)
        out += self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                          name=call.name, arguments=call.arguments)  # fmt: skip
        return out + self.event("response.output_item.done", output_index=index, item=item)


def settle(response: r.Response, finished: Finished, reasoning_tokens: int) -> None:
    """Fill in how ``response`` ended and what it used."""
    usage: EngineUsage = finished.usage
    response.usage = r.ResponseUsage(
        usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
        r.InputTokensDetails(usage.cached_tokens), r.OutputTokensDetails(min(reasoning_tokens, usage.completion_tokens)),
    )  # fmt: skip
    if finished.reason == "length":
        response.status, response.incomplete_details = "incomplete", r.IncompleteDetails("max_output_tokens")
    else:
        response.status = "completed"


def output_messages(items: list[r.OutputItem]) -> list[dict[str, Any]]:
    """The output as the assistant turn a follow-up request renders."""
    content = "".join(part.text for item in items if isinstance(item, r.MessageItem) for part in item.content)
    reasoning = "".join(part.text for item in items if isinstance(item, r.ReasoningItem) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, r.FunctionCallItem)]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return [message]


# -- the operations ------------------------------------------------------------------------------


class Responses:
    """The Responses API over a server context and its store (None: ``store`` is refused)."""

    def __init__(self, ctx: ServerContext, store: ResponseStore | None, runs: BackgroundRuns | None = None):
        self.ctx = ctx
        self.store = store
        self.runs = runs if runs is not None else BackgroundRuns()

    async def create(self, body: r.ResponsesRequest, params: Any, request: Any) -> Any:
        """Answer ``body`` (``params``: its SamplingParams, from the shared mapping)."""
        ctx = self.ctx
        owner = key_owner(request)
        if body.background and not (body.store and self.store is not None):
            raise RequestError("background responses are stored: send store true (and keep "
                               "openai.responses_store on)", field="background")  # fmt: skip
        previous = await self._previous(body.previous_response_id, owner)
        inputs = _history_images(previous.messages) if previous else []
        messages, listed = input_messages(body.input, inputs, compaction_seal(ctx))
        answered, approved = await answer_approvals(ctx, body.input, previous.response if previous else None)
        history = (previous.messages if previous else []) + answered + messages
        chat = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
        ready_engine(ctx)  # a 503 while the engine is not ready
        info = await loaded_model(ctx, body.model)
        images = await load_images(ctx.config.server, info, inputs)
        tools, choice, parallel = tool_request(body)
        mcp = await open_tools(ctx, [(i, tool) for i, tool in enumerate(body.tools or []) if tool.type == "mcp"])
        choice = check_choice(mcp, body.tool_choice, choice)
        if mcp is not None:
            if body.stream or body.background:
                raise RequestError("requests with mcp tools are served without stream and background",
                                   field="stream" if body.stream else "background")  # fmt: skip
            tools = tools + mcp.offered()
            if body.tool_choice is None:
                choice = ToolChoice("auto")
        params.constraint = text_constraint(ctx, body.text)
        effort = body.reasoning.effort if body.reasoning is not None else None
        variables = template_variables(body.chat_template_kwargs, effort=effort)
        prepare = functools.partial(
            prepare_chat, info, model_parsers(ctx, info), _without_image_data(chat), tools=tools,
            choice=choice, parallel=parallel, template_kwargs=variables, images=images,
        )  # fmt: skip
        if mcp is not None or approved:
            response = self._response(body, tools, choice)
            response.output.extend(approved)
            return await self._with_tools(mcp, prepare, params, request, response, chat, history, listed, info, owner, body)
        setup: ChatSetup = await prepare_in_thread(ctx, request, prepare)
        params.constraint = setup.constraint or params.constraint
        limit_thinking(params, setup, effort=effort)
        generation = GenerationRequest(
            body.model, setup.prompt_ids, params, keep_special=setup.keep_special, images=images
        )
        handle = submit(ctx, generation)
        response = self._response(body, tools, choice)
        if body.background:
            return await self._background(handle, setup.reader(), response, history, listed, info.tokenizer, owner, body.stream)
        if body.stream:
            return self._stream(handle, setup.reader(), response, history, listed, info.tokenizer, owner)
        reply = await collect(ctx, handle, request)
        builder = OutputBuilder(response)
        reader = setup.reader()
        builder.feed(reader.feed(reply.text) + reader.finish())
        builder.finish()
        settle(response, reply.finished, _count(info.tokenizer, response.output))
        await self._keep(body, response, listed, history, owner)
        return response

    async def _with_tools(
        self, mcp: McpTools | None, prepare: Any, params: Any, request: Any, response: r.Response,
        chat: list[dict[str, Any]], history: list[dict[str, Any]], listed: list[dict[str, Any]],
        info: Any, owner: str | None, body: r.ResponsesRequest,
    ) -> r.Response:  # fmt: skip
        """A response whose model may call MCP tools the server runs between its turns (or that
        answers approvals): each turn rendered from the chat so far, generated and read."""
        ctx = self.ctx
        effort = body.reasoning.effort if body.reasoning is not None else None

        async def turn(turn_chat: list[dict[str, Any]], first: bool = True) -> tuple[list[r.OutputItem], Finished]:
            # A forced tool choice forces the first turn's call; after its result the model goes on
            # as it will (forced every turn, the loop could only end at its bounds).
            keywords = prepare.keywords if first else {**prepare.keywords, "choice": ToolChoice("auto")}
            render = functools.partial(prepare.func, *prepare.args[:2], _without_image_data(turn_chat), **keywords)
            setup: ChatSetup = await prepare_in_thread(ctx, request, render)
            turn_params = copy.deepcopy(params)
            turn_params.constraint = setup.constraint or params.constraint
            limit_thinking(turn_params, setup, effort=effort)
            handle = submit(ctx, GenerationRequest(body.model, setup.prompt_ids, turn_params, keep_special=setup.keep_special,
                                                   images=list(prepare.keywords["images"])))  # fmt: skip
            reply = await collect(ctx, handle, request)
            scratch = msgspec.structs.replace(response, output=[])
            builder, reader = OutputBuilder(scratch), setup.reader()
            builder.feed(reader.feed(reply.text) + reader.finish())
            builder.finish()
            return scratch.output, reply.finished

        if mcp is None:
            items, finished = await turn(chat)
            response.output.extend(items)
            finishes, final, bounded = [finished], items, False
            added: list[dict[str, Any]] = []
        else:
            finishes, added, final, bounded = await run_turns(ctx, mcp, turn, chat, response)
        usage = EngineUsage(sum(f.usage.prompt_tokens for f in finishes), sum(f.usage.completion_tokens for f in finishes),
                            sum(f.usage.cached_tokens for f in finishes))  # fmt: skip
        settle(response, attrs.evolve(finishes[-1], usage=usage), _count(info.tokenizer, response.output))
        if bounded:
            response.status, response.incomplete_details = "incomplete", r.IncompleteDetails("max_turns")
        if body.store and self.store is not None:
            item = Stored(response.id, response.model, msgspec.to_builtins(response), listed,
                          history + added + output_messages(final), owner)  # fmt: skip
            await anyio.to_thread.run_sync(self.store.put, item)
        return response

    # ``owner``: the requesting API key's owner id (None without keys); another key's responses
    # are not found.

    async def get(self, response_id: str, owner: str | None) -> r.Response | r.CompactedResponse:
        run = self.runs.get(response_id, owner)
        if run is not None:
            return run.response
        stored = await self._load(response_id, owner)
        if stored.response.get("object") == "response.compaction":
            return msgspec.convert(stored.response, r.CompactedResponse)
        return msgspec.convert(stored.response, r.Response)

    async def stream_again(self, response_id: str, owner: str | None, starting_after: int) -> Stream:
        """A background response's events after number ``starting_after``, then the rest as they
        come (leaving early leaves the response running)."""
        run = self.runs.get(response_id, owner)
        if run is None:
            await self._load(response_id, owner)  # a 404 for an unknown id
            raise RequestError("only a background response that is running or finished lately can be streamed "
                               "again; GET it without stream", field="stream")  # fmt: skip
        return Stream(run.follow(starting_after), media_type="text/event-stream", headers=SSE_HEADERS)

    async def cancel(self, response_id: str, owner: str | None) -> r.Response:
        """End a background response (status ``cancelled``); one already ended is answered as it is."""
        run = self.runs.get(response_id, owner)
        if run is None:
            response = await self.get(response_id, owner)
            if not isinstance(response, r.Response) or not response.background:
                raise RequestError("only background responses can be cancelled", field="response_id")
            return response
        if not run.done:
            run.response.status = "cancelled"
            run.handle.cancel()
            if run.task is not None:
                await asyncio.shield(run.task)
        return run.response

    async def input_items(self, response_id: str, owner: str | None) -> r.InputItemList:
        items = (await self._load(response_id, owner)).input_items
        return r.InputItemList(items[::-1], items[-1]["id"] if items else None, items[0]["id"] if items else None)

    async def delete(self, response_id: str, owner: str | None) -> r.Deleted:
        store = self._store()
        if not await anyio.to_thread.run_sync(store.delete, response_id, owner):
            raise ResponseNotFound(response_id)
        return r.Deleted(response_id)

    # -- helpers --

    def _store(self) -> ResponseStore:
        if self.store is None:
            raise RequestError("stored responses are off on this server (openai.responses_store)", field="store")
        return self.store

    async def _load(self, response_id: str, owner: str | None, param: str | None = None) -> Stored:
        stored = await anyio.to_thread.run_sync(self._store().get, response_id, owner)
        if stored is None:
            raise ResponseNotFound(response_id, param)
        return stored

    async def _previous(self, response_id: str | None, owner: str | None) -> Stored | None:
        return None if response_id is None else await self._load(response_id, owner, "previous_response_id")

    async def _keep(
        self, body: r.ResponsesRequest, response: r.Response, listed: list[dict[str, Any]],
        history: list[dict[str, Any]], owner: str | None,
    ) -> None:  # fmt: skip
        if body.store and self.store is not None:
            item = Stored(response.id, response.model, msgspec.to_builtins(response), listed,
                          history + output_messages(response.output), owner)  # fmt: skip
            await anyio.to_thread.run_sync(self.store.put, item)

    def _response(self, body: r.ResponsesRequest, tools: list[Tool], choice: ToolChoice) -> r.Response:
        fmt = body.text.format if body.text and body.text.format else r.TextFormat()
        tool_choice: Any = choice.mode if choice.mode != "function" else {"type": "function", "name": choice.name}
        if choice.mode == "function" and isinstance(body.tool_choice, r.NamedToolChoiceFields) and body.tool_choice.type == "mcp":
            tool_choice = {"type": "mcp", "server_label": body.tool_choice.server_label, "name": choice.name}
        return r.Response(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), model=body.model, output=[],
            status="in_progress", instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            reasoning={"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            store=body.store and self.store is not None, temperature=body.temperature,
            text={"format": msgspec.to_builtins(fmt)}, tool_choice=tool_choice,
            tools=[{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                    "strict": False} for t in tools],
            top_p=body.top_p, user=body.user, metadata=body.metadata or {},
        )  # fmt: skip

    def _stream(
        self,
        handle: RequestHandle,
        reader: ReplyReader,
        response: r.Response,
        history: list[dict[str, Any]],
        listed: list[dict[str, Any]],
        tokenizer: Any,
        owner: str | None,
    ) -> Stream:
        builder = OutputBuilder(response)
        events = self._events(handle, reader, builder, history, listed, tokenizer, owner)

        async def cancel() -> None:
            handle.cancel()

        return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(cancel))

    async def _background(
        self,
        handle: RequestHandle,
        reader: ReplyReader,
        response: r.Response,
        history: list[dict[str, Any]],
        listed: list[dict[str, Any]],
        tokenizer: Any,
        owner: str | None,
        stream: bool,
    ) -> Any:
        """Start ``response`` as a background run: stored as ``queued`` at once, then driven by a
        task of its own; answered now (``stream``: its events, followed)."""
        response.background, response.status = True, "queued"
        run = Run(response, owner, handle)
        self.ctx.inflight.name(handle, response.id, owner)  # its owner may cancel it by this id too
        await self._put(response, listed, history, owner)
        builder = OutputBuilder(response, sink=run.record)
        self.runs.start(run, self._events(handle, reader, builder, history, listed, tokenizer, owner))
        if stream:
            return Stream(run.follow(), media_type="text/event-stream", headers=SSE_HEADERS)
        return response

    async def _events(
        self,
        handle: RequestHandle,
        reader: ReplyReader,
        builder: OutputBuilder,
        history: list[dict[str, Any]],
        listed: list[dict[str, Any]],
        tokenizer: Any,
        owner: str | None,
    ) -> AsyncIterator[bytes]:
        """The stream of one response's events, the response stored (where asked) at its end."""
        response = builder.response
        stream = tracked_events(self.ctx, handle)
        try:
            if response.status == "queued":
                yield builder.event("response.queued", response=response)
            response.status = "in_progress"
            yield builder.event("response.created", response=response)
            yield builder.event("response.in_progress", response=response)
            async for event in stream:
                if isinstance(event, Delta):
                    if event.text:
                        data = builder.feed(reader.feed(event.text))
                        if data:
                            yield data
                    continue
                if isinstance(event, Failed) and isinstance(event.error, RequestCancelled):
                    response.status = "cancelled"  # an operator's POST /v1/requests/{id}/cancel
                if response.status == "cancelled":  # POST .../cancel
                    yield builder.feed(reader.finish()) + builder.finish()
                    await self._put(response, listed, history, owner)
                    break
                if isinstance(event, Failed) or event.reason == "cancelled":
                    error = event.error if isinstance(event, Failed) else shutdown_cancelled()
                    yield self._failed(builder, response, error)
                    if response.background:
                        await self._put(response, listed, history, owner)
                    break
                yield builder.feed(reader.finish()) + builder.finish()
                settle(response, event, _count(tokenizer, response.output))
                await self._put(response, listed, history, owner)
                kind = "response.completed" if response.status == "completed" else "response.incomplete"
                yield builder.event(kind, response=response)
        finally:
            await stream.aclose()

    async def _put(
        self, response: r.Response, listed: list[dict[str, Any]], history: list[dict[str, Any]], owner: str | None
    ) -> None:
        if response.store and self.store is not None:
            item = Stored(response.id, response.model, msgspec.to_builtins(response), listed,
                          history + output_messages(response.output), owner)  # fmt: skip
            await anyio.to_thread.run_sync(self.store.put, item)

    @staticmethod
    def _failed(builder: OutputBuilder, response: r.Response, error: MlxrError) -> bytes:
        body = msgspec.json.decode(error_body(error))["error"]
        response.status = "failed"
        response.error = r.ResponseError(str(body.get("code") or body.get("type") or "server_error"), str(body["message"]))
        return builder.event("error", code=response.error.code, message=response.error.message, field=body.get("param")) + (
            builder.event("response.failed", response=response)
        )


def _count(tokenizer: Any, items: list[r.OutputItem]) -> int:
    """Tokens of the reasoning in ``items`` (what ``output_tokens_details.reasoning_tokens`` says)."""
    text = "".join(part.text for item in items if isinstance(item, r.ReasoningItem) for part in item.content)
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def response_routes(ctx: ServerContext) -> list[Any]:
    """The Responses API's route handlers (under ``/v1`` and unprefixed, as the OpenAI router's
    others). The store opens at the first request that needs it."""
    from mlxr_plugins.apis.openai.routes import paths
    config = ctx.config.server.responses_store
    opened: list[ResponseStore] = []

    def store() -> ResponseStore | None:
        if not config.enabled:
            return None
        if not opened:
            path = config.path or data_dir() / "responses.sqlite3"
            opened.append(ResponseStore(path, max_bytes=config.max_bytes, max_age_s=config.max_age_s,
                                        max_items=config.max_items))  # fmt: skip
        return opened[0]

    runs = BackgroundRuns()

    def api() -> Responses:
        return Responses(ctx, store(), runs)

    @post(paths("/responses"), status_code=200, operation_class=documented(
        response=r.Response, error=ErrorBody, stream=EventStream("text/event-stream", (r.StreamEvent,))))  # fmt: skip
    async def create(data: JSONBody[r.ResponsesRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        body = data
        params = sampling_params(
            ctx, max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed,
        )  # fmt: skip
        reply = await api().create(body, params, request)
        return reply if isinstance(reply, Stream) else json_response(reply)

    @post(paths("/responses/compact"), status_code=200, operation_class=documented(
        response=r.CompactedResponse, error=ErrorBody))  # fmt: skip
    async def compact_route(data: JSONBody[r.CompactRequest], request: Request[Any, Any, Any]) -> Response[Any]:
        return json_response(await compact(api(), data, request))

    path = "/responses/{response_id:str}"

    errors = documented(error=ErrorBody)

    @get(paths(path), operation_class=documented(
        response=r.Response, error=ErrorBody, stream=EventStream("text/event-stream", (r.StreamEvent,))))  # fmt: skip
    async def retrieve(
        response_id: FromPath[str], request: Request[Any, Any, Any],
        stream: FromQuery[bool] = False, starting_after: FromQuery[int] = -1,
    ) -> Response[Any]:  # fmt: skip
        if stream:
            return await api().stream_again(response_id, key_owner(request), starting_after)
        return json_response(await api().get(response_id, key_owner(request)))

    @post(paths(path + "/cancel"), status_code=200, operation_class=errors)
    async def cancel(response_id: FromPath[str], request: Request[Any, Any, Any]) -> r.Response:
        return await api().cancel(response_id, key_owner(request))

    @delete(paths(path), status_code=200, operation_class=errors)
    async def remove(response_id: FromPath[str], request: Request[Any, Any, Any]) -> r.Deleted:
        return await api().delete(response_id, key_owner(request))

    @get(paths(path + "/input_items"), operation_class=errors)
    async def input_items(response_id: FromPath[str], request: Request[Any, Any, Any]) -> r.InputItemList:
        return await api().input_items(response_id, key_owner(request))

    return [create, compact_route, retrieve, remove, input_items, cancel]
