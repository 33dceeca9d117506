"""Engine events -> Anthropic Messages responses: one JSON message, or server-sent events.

A stream is ``message_start``, ``ping``, then each content block in order (``content_block_start``,
its deltas, ``content_block_stop``): ``thinking`` (``thinking_delta``), ``text`` (``text_delta``) and
``tool_use`` (its input as one ``input_json_delta``), as the reply reader splits the text; then
``message_delta`` (stop reason, output tokens) and ``message_stop``. A reply with no block at all
still gets one empty text block. A request that fails mid-stream ends with an ``error``
event instead, which Anthropic clients raise. A client that leaves cancels its request (see
:func:`mlxr_core.http.frontend.tracked_events`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.chat.parsing import Text, ToolCall, merge
from mlxr_core.chat.tools import ReplyReader
from mlxr_core.engine.request import Delta, Failed, Finished, RequestHandle
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import shutdown_cancelled, tracked_events
from mlxr_plugins.apis.anthropic import schemas as s
from mlxr_plugins.apis.anthropic.errors import error_body

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@attrs.frozen
class MessageMeta:
    """What the message and every event of one request repeat."""

    id: str
    model: str
    input_tokens: int
    #: Whether the request marks a ``cache_control`` breakpoint (cache writes are reported then).
    breakpoints: bool = False


def stop_reason(finished: Finished, calls: int = 0) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for the engine's finish."""
    if finished.reason == "length":
        return "max_tokens", None
    if finished.stop_sequence is not None:
        return "stop_sequence", finished.stop_sequence
    if calls:
        return "tool_use", None
    return "end_turn", None


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message(meta: MessageMeta, reader: ReplyReader, text: str, finished: Finished) -> s.MessageResponse:
    """The whole message of a non-streaming reply."""
    blocks: list[s.Block] = []
    for piece in merge(reader.feed(text) + reader.finish()):
        if isinstance(piece, ToolCall):
            blocks.append(s.ToolUseBlock(piece.id, piece.name, _input(piece.arguments)))
        elif piece.kind == "reasoning":
            blocks.append(s.ThinkingBlock(piece.text))
        elif piece.text:
            blocks.append(s.TextBlock(piece.text))
    if not blocks:
        blocks.append(s.TextBlock(""))
    reason, sequence = stop_reason(finished, reader.calls)
    usage = s.Usage.of(finished.usage, breakpoints=meta.breakpoints)
    return s.MessageResponse(meta.id, meta.model, blocks, reason, sequence, usage)


class BlockWriter:
    """Stream events for the pieces of one reply: opens a block when the kind changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: s.Block) -> bytes:
        head = self.close()
        self.index += 1
        self.open = kind
        return head + event("content_block_start", s.ContentBlockStart(self.index, block))

    def close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", s.ContentBlockStop(self.index))

    def pieces(self, pieces: list[Text | ToolCall]) -> bytes:
        out = b""
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out += self._start("tool_use", s.ToolUseBlock(piece.id, piece.name, {}))
                out += event("content_block_delta", s.ContentBlockDelta(self.index, s.InputJsonDelta(piece.arguments)))
                out += self.close()
                continue
            if not piece.text:
                continue
            if piece.kind == "reasoning":
                if self.open != "thinking":
                    out += self._start("thinking", s.ThinkingBlock(""))
                delta: Any = s.ThinkingDelta(piece.text)
            else:
                if self.open != "text":
                    out += self._start("text", s.TextBlock(""))
                delta = s.TextDelta(piece.text)
            out += event("content_block_delta", s.ContentBlockDelta(self.index, delta))
        return out

    def finish(self) -> bytes:
        out = b""
        if self.index < 0:
            out += self._start("text", s.TextBlock(""))
        return out + self.close()


def sse_response(ctx: ServerContext, handle: RequestHandle, meta: MessageMeta, reader: ReplyReader) -> Stream:
    """A ``text/event-stream`` response of ``handle``'s events as Anthropic stream events."""

    async def cancel() -> None:
        handle.cancel()  # in case the stream never started

    return Stream(
        _events(ctx, handle, meta, reader), media_type="text/event-stream", headers=SSE_HEADERS,
        background=BackgroundTask(cancel),
    )


async def _events(
    ctx: ServerContext, handle: RequestHandle, meta: MessageMeta, reader: ReplyReader
) -> AsyncIterator[bytes]:
    events = tracked_events(ctx, handle)
    blocks = BlockWriter()
    try:
        start = s.MessageResponse(meta.id, meta.model, [], None, None, s.Usage(meta.input_tokens, 0))
        yield event("message_start", s.MessageStart(start))
        yield event("ping", s.Ping())
        async for item in events:
            if isinstance(item, Delta):
                if item.text and (data := blocks.pieces(reader.feed(item.text))):
                    yield data
            elif isinstance(item, Finished):
                if item.reason == "cancelled":
                    yield error_event(error_body(shutdown_cancelled()))
                    break
                yield blocks.pieces(reader.finish()) + blocks.finish()
                reason, sequence = stop_reason(item, reader.calls)
                usage = s.OutputUsage.of(item.usage, breakpoints=meta.breakpoints)
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
