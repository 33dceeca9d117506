"""Engine events -> Anthropic Messages responses: one JSON message, or server-sent events.

A stream is ``message_start``, ``content_block_start`` (one text block), ``ping``, a
``content_block_delta`` per piece of text, then ``content_block_stop``, ``message_delta`` (stop
reason, output tokens) and ``message_stop``. A request that fails mid-stream ends with an ``error``
event instead, which Anthropic clients raise. A client that leaves cancels its request (see
:func:`mlxr_core.frontend.tracked_events`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.engine.request import Delta, Failed, Finished, RequestHandle
from mlxr_core.frontend import shutdown_cancelled, tracked_events
from mlxr_core.server import ServerContext
from mlxr_plugins.apis.anthropic import schemas as s
from mlxr_plugins.apis.anthropic.errors import error_body

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@attrs.frozen
class MessageMeta:
    """What the message and every event of one request repeat."""

    id: str
    model: str
    input_tokens: int


def stop_reason(finished: Finished) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for the engine's finish."""
    if finished.reason == "length":
        return "max_tokens", None
    if finished.stop_sequence is not None:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def message(meta: MessageMeta, text: str, finished: Finished) -> s.MessageResponse:
    """The whole message of a non-streaming reply."""
    reason, sequence = stop_reason(finished)
    usage = s.Usage(finished.usage.prompt_tokens, finished.usage.completion_tokens)
    return s.MessageResponse(meta.id, meta.model, [s.TextBlock(text)], reason, sequence, usage)


def sse_response(ctx: ServerContext, handle: RequestHandle, meta: MessageMeta) -> Stream:
    """A ``text/event-stream`` response of ``handle``'s events as Anthropic stream events."""

    async def cancel() -> None:
        handle.cancel()  # in case the stream never started

    return Stream(
        _events(ctx, handle, meta), media_type="text/event-stream", headers=SSE_HEADERS,
        background=BackgroundTask(cancel),
    )


async def _events(ctx: ServerContext, handle: RequestHandle, meta: MessageMeta) -> AsyncIterator[bytes]:
    events = tracked_events(ctx, handle)
    try:
        start = s.MessageResponse(meta.id, meta.model, [], None, None, s.Usage(meta.input_tokens, 0))
        yield event("message_start", s.MessageStart(start))
        yield event("content_block_start", s.ContentBlockStart(0, s.TextBlock("")))
        yield event("ping", s.Ping())
        async for item in events:
            if isinstance(item, Delta):
                if item.text:
                    yield event("content_block_delta", s.ContentBlockDelta(0, s.TextDelta(item.text)))
            elif isinstance(item, Finished):
                if item.reason == "cancelled":
                    yield error_event(error_body(shutdown_cancelled()))
                    break
                reason, sequence = stop_reason(item)
                yield event("content_block_stop", s.ContentBlockStop(0))
                usage = s.OutputUsage(item.usage.completion_tokens)
                yield event("message_delta", s.MessageDelta(s.StopInfo(reason, sequence), usage))
                yield event("message_stop", s.MessageStop())
            elif isinstance(item, Failed):
                yield error_event(error_body(item.error))
    finally:
        await events.aclose()  # cancels the request if the client left mid-stream


def event(name: str, data: object) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + s.encoder.encode(data) + b"\n\n"


def error_event(body: bytes) -> bytes:
    return b"event: error\ndata: " + body + b"\n\n"
