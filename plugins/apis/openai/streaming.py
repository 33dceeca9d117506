"""Engine events -> OpenAI responses: one JSON body, or server-sent events.

A client that goes away cancels its request, whichever way it leaves:

- streaming: the SSE generator cancels in ``finally``. Litestar only stops iterating when the
  client disconnects (litestar#3772), so the producer must stop its own work; the response's
  background task cancels again in case the generator was parked at a ``yield`` and is never
  resumed;
- non-streaming: :func:`mlxr_core.frontend.collect` watches the connection while it waits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import msgspec
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.engine.request import Delta, Failed, Finished, RequestHandle
from mlxr_core.engine.request import Usage as EngineUsage
from mlxr_core.frontend import shutdown_cancelled, tracked_events
from mlxr_core.parsing import Text, ToolCall
from mlxr_core.server import ServerContext
from mlxr_core.tool_calling import ReplyReader
from mlxr_plugins.apis.openai import schemas as s
from mlxr_plugins.apis.openai.errors import error_body
from mlxr_plugins.apis.openai.tools import deltas

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


@attrs.frozen
class ResponseMeta:
    """What every response or chunk of one request repeats."""

    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))


def usage_of(usage: EngineUsage) -> s.Usage:
    return s.Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


class ChatChunks:
    """The SSE chunks of a chat completion; with a ``reader``, the text is split into reasoning,
    content and tool calls as it streams."""

    def __init__(self, meta: ResponseMeta, include_usage: bool, reader: ReplyReader | None = None):
        self.meta = meta
        self.include_usage = include_usage
        self.reader = reader

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> bytes:
        m = self.meta
        field: Any = usage if self.include_usage else msgspec.UNSET
        return sse_event(s.encoder.encode(s.ChatCompletionChunk(m.id, m.created, m.model, choices, usage=field)))

    def first(self) -> bytes | None:
        return self._chunk([s.ChatChunkChoice(0, s.ChatDelta(role="assistant", content=""))])

    def text(self, text: str) -> bytes:
        if self.reader is None:
            return self._chunk([s.ChatChunkChoice(0, s.ChatDelta(content=text))])
        return self._pieces(self.reader.feed(text))

    def finish(self, reason: str) -> bytes:
        head = b""
        if self.reader is not None:
            head = self._pieces(self.reader.finish())
            reason = self.reader.finish_reason(reason)
        return head + self._chunk([s.ChatChunkChoice(0, s.ChatDelta(), finish_reason=reason)])

    def _pieces(self, pieces: list[Text | ToolCall]) -> bytes:
        assert self.reader is not None
        calls = sum(isinstance(piece, ToolCall) for piece in pieces)
        found = deltas(pieces, self.reader.calls - calls)
        return b"".join(self._chunk([s.ChatChunkChoice(0, delta)]) for delta in found)

    def usage(self, usage: EngineUsage) -> bytes | None:
        return self._chunk([], usage_of(usage)) if self.include_usage else None


class CompletionChunks:
    """The SSE chunks of a text completion."""

    def __init__(self, meta: ResponseMeta, include_usage: bool):
        self.meta = meta
        self.include_usage = include_usage

    def _chunk(self, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> bytes:
        m = self.meta
        field: Any = usage if self.include_usage else msgspec.UNSET
        return sse_event(s.encoder.encode(s.Completion(m.id, m.created, m.model, choices, usage=field)))

    def first(self) -> bytes | None:
        return None

    def text(self, text: str) -> bytes:
        return self._chunk([s.CompletionChoice(0, text)])

    def finish(self, reason: str) -> bytes:
        return self._chunk([s.CompletionChoice(0, "", finish_reason=reason)])

    def usage(self, usage: EngineUsage) -> bytes | None:
        return self._chunk([], usage_of(usage)) if self.include_usage else None


def sse_response(ctx: ServerContext, handle: RequestHandle, chunks: ChatChunks | CompletionChunks) -> Stream:
    """A ``text/event-stream`` response streaming ``handle``'s events as ``chunks``."""

    async def cancel() -> None:
        handle.cancel()

    return Stream(
        _events(ctx, handle, chunks),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(cancel),
    )


async def _events(
    ctx: ServerContext, handle: RequestHandle, chunks: ChatChunks | CompletionChunks
) -> AsyncIterator[bytes]:
    events = tracked_events(ctx, handle)
    try:
        first = chunks.first()
        if first is not None:
            yield first
        async for event in events:
            if isinstance(event, Delta):
                if event.text and (data := chunks.text(event.text)):
                    yield data
            elif isinstance(event, Finished):
                if event.reason == "cancelled":
                    yield sse_event(error_body(shutdown_cancelled()))
                    break
                yield chunks.finish(event.reason)
                usage = chunks.usage(event.usage)
                if usage is not None:
                    yield usage
            elif isinstance(event, Failed):
                # Headers are sent: the error travels as an event, which OpenAI clients raise.
                yield sse_event(error_body(event.error))
        yield DONE
    finally:
        await events.aclose()  # cancels the request if the client left mid-stream


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
