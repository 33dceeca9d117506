"""MCP tools through chat completions: the servers configured with ``chat: true`` under
``mcp.servers`` offer their tools (their ``allowed_tools``) to every ``POST /v1/chat/completions``
that does not send ``tool_choice: "none"``, beside the request's own functions (a function of the
request's shadows an MCP tool of its name; of two servers listing one name, the first configured
wins). Their servers are listed together (the lists kept ``mcp.chat_list_ttl_s`` seconds), and
one that fails is reported, not offered.

The server runs the model's calls of those tools between its turns and feeds the results back, at
most ``mcp.max_turns`` turns and ``mcp.max_seconds`` seconds (then ``finish_reason`` is
``length``). The chat API has no items for this, so the reply's message carries an extension field,
``mcp_output``: an ``mcp_call`` per call (``output``, or ``error`` as an OpenAI error object: a
tool that failed, a server that crashed or did not answer within its ``timeout_s``; the model is
told the error and goes on) and an ``mcp_list_tools`` per server that could not be listed. The
message's ``content`` is the text of every turn, in order; its ``tool_calls`` only the request's own
functions: a turn that calls one ends the loop as ``tool_calls`` (that turn's MCP calls still run).
Streamed, the turns' text streams as it is generated and each call arrives as a delta holding its
``mcp_output`` item once it has run. No call asks for approval: configuring ``chat: true`` is the
operator's approval.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import attrs
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.chat.parsing import Text, ToolCall
from mlxr_core.chat.thinking import limit_thinking
from mlxr_core.chat.tools import ChatSetup, ToolChoice
from mlxr_core.config.schema import McpServerConfig
from mlxr_core.engine.request import (
    Delta,
    Failed,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from mlxr_core.engine.request import Usage as EngineUsage
from mlxr_core.errors import MlxrError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import (
    prepare_in_thread,
    shutdown_cancelled,
    submit,
    tracked_events,
    unless_disconnected,
)
from mlxr_core.http.mcp_client import McpTool, ToolError, list_tools
from mlxr_plugins.apis.openai import schemas as s
from mlxr_plugins.apis.openai.errors import error_body
from mlxr_plugins.apis.openai.mcp_tools import McpTools
from mlxr_plugins.apis.openai.streaming import (
    DONE,
    SSE_HEADERS,
    ChatChunks,
    ResponseMeta,
    sse_event,
    usage_of,
)
from mlxr_plugins.apis.openai.tools import response_calls


def error_detail(error: ToolError) -> s.ErrorDetail:
    """A failed MCP list or call as an OpenAI error object."""
    return s.ErrorDetail(str(error), "mcp_error", code=error.code)


@attrs.define
class ToolListings:
    """The tools each server with ``chat: true`` listed, kept ``mcp.chat_list_ttl_s`` seconds; a
    failure is kept too, so a server that hangs costs its timeout once a period, not every request."""

    kept: dict[str, tuple[float, list[McpTool] | ToolError]] = attrs.field(factory=dict)

    async def tools(self, server: McpServerConfig, ttl: float) -> list[McpTool] | ToolError:
        hit = self.kept.get(server.name)
        if hit is not None and time.monotonic() - hit[0] < ttl:
            return hit[1]
        try:
            listed: list[McpTool] | ToolError = await list_tools(server)
        except ToolError as error:
            listed = error
        self.kept[server.name] = (time.monotonic(), listed)
        return listed


async def chat_tools(
    ctx: ServerContext, listings: ToolListings, shadowed: set[str]
) -> tuple[McpTools, list[s.McpListTools]] | None:
    """The tools of the servers configured for chat completions (None: none is), listed together,
    less the names in ``shadowed`` (the request's functions); and the servers that failed to list."""
    servers = [server for server in ctx.config.mcp.servers if server.chat]
    if not servers:
        return None
    ttl = ctx.config.mcp.chat_list_ttl_s
    found = McpTools({server.name: server for server in servers})
    failed: list[s.McpListTools] = []
    listed = await asyncio.gather(*(listings.tools(server, ttl) for server in servers))
    for server, tools in zip(servers, listed, strict=True):
        if isinstance(tools, ToolError):
            failed.append(s.McpListTools(f"mcpl_{uuid.uuid4().hex}", server.name, error_detail(tools)))
            continue
        for tool in tools:
            if tool.name not in shadowed and tool.name not in found.tools:
                found.tools[tool.name] = tool
    return found, failed


@attrs.frozen
class Said:
    """Text of a turn, and the request's own function calls (MCP calls are withheld)."""

    pieces: list[Text | ToolCall]
    logprobs: Sequence[TokenLogprob] = ()


@attrs.frozen
class Ran:
    """An MCP call that ran, or a server that could not be listed."""

    item: s.McpCall | s.McpListTools


@attrs.frozen
class Ended:
    """The loop's end: the chat API's finish reason and every turn's usage summed."""

    reason: str
    usage: EngineUsage


@attrs.define
class TurnState:
    """What one turn said so far: its text (for the chat the next turn reads) and its calls."""

    mcp_calls: list[ToolCall] = attrs.field(factory=list)
    client_calls: int = 0
    content: list[str] = attrs.field(factory=list)


@attrs.define
class McpChat:
    """One chat completion whose model may call the server's MCP tools: ``prepare`` renders the
    request's chat (``prepare_chat`` with its arguments), ``generation`` makes a turn's request."""

    ctx: ServerContext
    request: Any
    mcp: McpTools
    failed: list[s.McpListTools]
    prepare: functools.partial[ChatSetup]
    params: SamplingParams
    generation: Callable[[ChatSetup, SamplingParams], GenerationRequest]
    effort: str | None = None
    handle: RequestHandle | None = None
    _first: tuple[ChatSetup, RequestHandle] | None = None

    async def start(self) -> None:
        """Render and submit the first turn (its refusals are the request's: a 4xx before any reply)."""
        self._first = await self._turn([], first=True)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    async def _turn(self, added: list[dict[str, Any]], *, first: bool) -> tuple[ChatSetup, RequestHandle]:
        # A forced tool choice holds on the first turn only: forced on every turn, the loop could
        # only end at its bounds.
        keywords = self.prepare.keywords if first else {**self.prepare.keywords, "choice": ToolChoice("auto")}
        messages = self.prepare.args[2] + added
        render = functools.partial(self.prepare.func, *self.prepare.args[:2], messages, **keywords)
        setup: ChatSetup = await prepare_in_thread(self.ctx, self.request, render)
        params = copy.deepcopy(self.params)
        params.constraint = setup.constraint or self.params.constraint
        limit_thinking(params, setup, effort=self.effort)
        self.handle = submit(self.ctx, self.generation(setup, params))
        return setup, self.handle

    async def events(self) -> AsyncGenerator[Said | Ran | Ended, None]:
        """The loop, turn after turn; raises what a turn's request fails with."""
        assert self._first is not None, "start() first"
        limits = self.ctx.config.mcp
        deadline = time.monotonic() + limits.max_seconds
        for failure in self.failed:
            yield Ran(failure)
        added: list[dict[str, Any]] = []
        usages: list[EngineUsage] = []
        for number in range(limits.max_turns):
            setup, handle = self._first if number == 0 else await self._turn(added, first=False)
            reader, turn, finished = setup.reader(), TurnState(), None
            async with aclosing(tracked_events(self.ctx, handle)) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        pieces = self._split(reader.feed(event.text), turn)
                        if pieces or event.logprobs:
                            yield Said(pieces, event.logprobs)
                    elif isinstance(event, Failed):
                        raise event.error
                    else:
                        finished = event
            if finished is None or finished.reason == "cancelled":
                raise shutdown_cancelled()
            pieces = self._split(reader.finish(), turn)
            if pieces:
                yield Said(pieces)
            usages.append(finished.usage)
            if not turn.mcp_calls or turn.client_calls or finished.reason != "stop":
                for call in turn.mcp_calls:  # a turn that also called the request's functions
                    yield Ran((await self._run(call))[0])
                reason = "tool_calls" if turn.client_calls and finished.reason == "stop" else finished.reason
                yield Ended(reason, _summed(usages))
                return
            added.append({"role": "assistant", "content": "".join(turn.content), "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in turn.mcp_calls]})  # fmt: skip
            for call in turn.mcp_calls:
                item, answer = await self._run(call)
                yield Ran(item)
                added.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": answer})
            if time.monotonic() > deadline:
                break
        yield Ended("length", _summed(usages))

    def _split(self, pieces: list[Text | ToolCall], turn: TurnState) -> list[Text | ToolCall]:
        """``pieces`` less the MCP calls (kept in ``turn``)."""
        shown: list[Text | ToolCall] = []
        for piece in pieces:
            if isinstance(piece, ToolCall) and piece.name in self.mcp.tools:
                turn.mcp_calls.append(piece)
                continue
            if isinstance(piece, ToolCall):
                turn.client_calls += 1
            elif piece.kind == "content":
                turn.content.append(piece.text)
            shown.append(piece)
        return shown

    async def _run(self, call: ToolCall) -> tuple[s.McpCall, str]:
        """The call's item, and what the model reads of it."""
        server = self.mcp.tools[call.name].server
        output, error = await self.mcp.run(server, call.name, call.arguments)
        detail = None if error is None else error_detail(error)
        item = s.McpCall(f"mcp_{uuid.uuid4().hex}", server, call.name, call.arguments, output, detail)
        return item, f"Error: {error}" if error is not None else output or ""


def _summed(usages: list[EngineUsage]) -> EngineUsage:
    """Every turn's prompt (each prefilled or read from the prefix cache) and completion counted."""
    return EngineUsage(
        sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in usages),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in usages),
    )  # fmt: skip


class McpChatChunks(ChatChunks):
    """The SSE chunks of a chat completion with MCP tools: the loop's pieces as deltas (the
    request's function calls numbered on across turns), each MCP item as a delta of its own."""

    client_calls = 0

    def said(self, pieces: list[Text | ToolCall], entries: Sequence[TokenLogprob]) -> bytes:
        logprobs = self.logprobs.chat(entries) if self.logprobs is not None and entries else None
        found = self._deltas(pieces, self.client_calls)
        self.client_calls += sum(isinstance(piece, ToolCall) for piece in pieces)
        return self._pieces(found, logprobs)

    def ran(self, item: s.McpCall | s.McpListTools) -> bytes:
        return self._chunk([s.ChatChunkChoice(self.index, s.ChatDelta(mcp_output=[item]))])


async def chat_completion(
    loop: McpChat, meta: ResponseMeta, stream: bool, chunks: McpChatChunks, encode: Callable[[str], list[int]] | None
) -> Any:
    """The chat completion of ``loop``: a stream of ``chunks``, or the whole reply (``encode``:
    counts its reasoning tokens, where the model reasons)."""
    await loop.start()
    if stream:
        return Stream(_stream(loop, chunks), media_type="text/event-stream", headers=SSE_HEADERS,
                      background=BackgroundTask(_cancel, loop))  # fmt: skip
    return await unless_disconnected(loop.request, _whole(loop, meta, chunks, encode))


async def _cancel(loop: McpChat) -> None:
    loop.cancel()


async def _whole(
    loop: McpChat, meta: ResponseMeta, chunks: McpChatChunks, encode: Callable[[str], list[int]] | None
) -> s.ChatCompletion:
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    items: list[s.McpOutputItem] = []
    entries: list[TokenLogprob] = []
    ended = None
    async for event in loop.events():
        if isinstance(event, Said):
            entries.extend(event.logprobs)
            for piece in event.pieces:
                if isinstance(piece, ToolCall):
                    calls.append(piece)
                else:
                    (reasoning if piece.kind == "reasoning" else content).append(piece.text)
        elif isinstance(event, Ran):
            items.append(event.item)
        else:
            ended = event
    assert ended is not None
    message = s.AssistantMessage(content="".join(content) or (None if calls else ""))
    if calls:
        message.tool_calls = response_calls(calls)
    if reasoning:
        message.reasoning_content = "".join(reasoning)
    if items:
        message.mcp_output = items
    logprobs = chunks.logprobs.chat(entries) if chunks.logprobs is not None else None
    thought = len(encode("".join(reasoning))) if encode is not None and reasoning else 0
    usage = usage_of(ended.usage, predicted=chunks.predicted, reasoning_tokens=thought if encode is not None else None)
    return s.ChatCompletion(meta.id, meta.created, meta.model, [s.ChatChoice(0, message, ended.reason, logprobs)], usage)


async def _stream(loop: McpChat, chunks: McpChatChunks) -> AsyncIterator[bytes]:
    events = loop.events()
    try:
        first = chunks.first()
        if first is not None:
            yield first
        async for event in events:
            if isinstance(event, Said):
                data = chunks.said(event.pieces, event.logprobs)
            elif isinstance(event, Ran):
                data = chunks.ran(event.item)
            else:
                data = chunks.finish(event.reason) + (chunks.usage(event.usage) or b"")
            if data:
                yield data
    except MlxrError as error:
        # Headers are sent: the error travels as an event, which OpenAI clients raise.
        yield sse_event(error_body(error))
    finally:
        await events.aclose()  # cancels the turn in flight if the client left
    yield DONE
