"""Engine events -> OpenAI responses: one JSON body, or server-sent events.

A client that goes away cancels its request, whichever way it leaves:

- streaming: the SSE generator cancels in ``finally``. Litestar only stops iterating when the
  client disconnects (litestar#3772), so the producer must stop its own work; the response's
  background task cancels again in case the generator was parked at a ``yield`` and is never
  resumed;
- non-streaming: :func:`collect` watches the connection while it waits for the text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import msgspec
from litestar import Request
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.engine.request import Delta, Failed, Finished, RequestHandle
from mlxr_core.engine.request import Usage as EngineUsage
from mlxr_core.errors import EngineStopped, MlxrError
from mlxr_plugins.apis.openai import schemas as s
from mlxr_plugins.apis.openai.errors import error_body

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


def cancelled_error() -> EngineStopped:
    """Why a request the client still waits for was cancelled: only shutdown does that."""
    return EngineStopped("the request was cancelled: the server is shutting down")


async def collect(handle: RequestHandle, request: Request[Any, Any, Any]) -> tuple[str, Finished]:
    """Wait for the whole text; cancel the request if the client disconnects meanwhile.

    Raises the request's error if it failed.
    """
    parts: list[str] = []
    last: Finished | Failed | None = None
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, request, handle, group.cancel_scope)
            async for event in handle.events():
                if isinstance(event, Delta):
                    parts.append(event.text)
                else:
                    last = event
            group.cancel_scope.cancel()
    finally:
        if last is None:
            handle.cancel()
    if last is None:  # the client left; nobody reads this
        raise MlxrError("the client disconnected")
    if isinstance(last, Failed):
        raise last.error
    if last.reason == "cancelled":
        raise cancelled_error()
    return "".join(parts), last


async def _cancel_on_disconnect(
    request: Request[Any, Any, Any], handle: RequestHandle, scope: anyio.CancelScope
) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()
    scope.cancel()


class ChatChunks:
    """The SSE chunks of a chat completion."""

    def __init__(self, meta: ResponseMeta, include_usage: bool):
        self.meta = meta
        self.include_usage = include_usage

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> bytes:
        m = self.meta
        field: Any = usage if self.include_usage else msgspec.UNSET
        return sse_event(s.encoder.encode(s.ChatCompletionChunk(m.id, m.created, m.model, choices, usage=field)))

    def first(self) -> bytes | None:
        return self._chunk([s.ChatChunkChoice(0, s.ChatDelta(role="assistant", content=""))])

    def text(self, text: str) -> bytes:
        return self._chunk([s.ChatChunkChoice(0, s.ChatDelta(content=text))])

    def finish(self, reason: str) -> bytes:
        return self._chunk([s.ChatChunkChoice(0, s.ChatDelta(), finish_reason=reason)])

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


def sse_response(handle: RequestHandle, chunks: ChatChunks | CompletionChunks) -> Stream:
    """A ``text/event-stream`` response streaming ``handle``'s events as ``chunks``."""

    async def cancel() -> None:
        handle.cancel()

    return Stream(
        _events(handle, chunks),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(cancel),
    )


async def _events(handle: RequestHandle, chunks: ChatChunks | CompletionChunks) -> AsyncIterator[bytes]:
    try:
        first = chunks.first()
        if first is not None:
            yield first
        async for event in handle.events():
            if isinstance(event, Delta):
                if event.text:
                    yield chunks.text(event.text)
            elif isinstance(event, Finished):
                if event.reason == "cancelled":
                    yield sse_event(error_body(cancelled_error()))
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
        handle.cancel()  # a no-op once finished; frees the engine when the client left


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
