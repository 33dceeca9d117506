"""Engine events -> Ollama responses: one JSON object, or NDJSON lines (Ollama's default).

Each line is a chunk (``done: false``) with the new text; the last has ``done: true``, the
``done_reason`` and the counters (durations in nanoseconds). A request that fails mid-stream ends
with an ``{"error": "..."}`` line, which Ollama clients raise. A client that leaves cancels its
request (see :func:`mlxr_core.http.frontend.tracked_events`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone

from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.chat.tools import ReplyReader
from mlxr_core.engine.request import Delta, Failed, Finished, RequestHandle
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import shutdown_cancelled, tracked_events
from mlxr_plugins.apis.ollama import schemas as s
from mlxr_plugins.apis.ollama.errors import error_line
from mlxr_plugins.apis.ollama.tools import assistant

NDJSON = "application/x-ndjson"


def rfc3339(epoch_s: float) -> str:
    """``2024-05-01T12:00:00.123456Z``, as Ollama writes ``created_at``."""
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Timer:
    """One request's clock: arrival, submission to the engine, and the final counters."""

    def __init__(self) -> None:
        self.arrived_ns = time.perf_counter_ns()
        self.submitted_ns = self.arrived_ns

    @property
    def created_at(self) -> str:
        return rfc3339(time.time())

    def submitted(self) -> None:
        self.submitted_ns = time.perf_counter_ns()

    def counters(self, finished: Finished) -> dict[str, int]:
        """Ollama's counters. ``load_duration`` is the time spent before the engine got the request
        (templating, tokenizing): models are loaded once, at startup."""
        return {
            "total_duration": time.perf_counter_ns() - self.arrived_ns,
            "load_duration": self.submitted_ns - self.arrived_ns,
            "prompt_eval_count": finished.usage.prompt_tokens,
            "prompt_eval_duration": int(finished.ttft_s * 1e9),
            "eval_count": finished.usage.completion_tokens,
            "eval_duration": max(0, int((finished.total_s - finished.ttft_s) * 1e9)),
        }


class ChatLines:
    """The chunks of ``/api/chat``."""

    def __init__(self, model: str, timer: Timer, reader: ReplyReader | None = None):
        self.model = model
        self.timer = timer
        #: Splits thinking and tool calls from the content as it streams.
        self.reader = reader

    def chunk(self, text: str) -> bytes:
        if self.reader is None:
            return _line(s.ChatChunk(self.model, self.timer.created_at, s.AssistantMessage(text), False))
        pieces = self.reader.feed(text)
        if not pieces:
            return b""
        return _line(s.ChatChunk(self.model, self.timer.created_at, assistant(pieces), False))

    def tokens(self, token_ids: Sequence[int]) -> None:
        """Chat replies carry no token context."""

    def whole(self, text: str, finished: Finished) -> s.ChatChunk:
        message = s.AssistantMessage(text)
        if self.reader is not None:
            message = assistant(self.reader.feed(text) + self.reader.finish())
        return s.ChatChunk(
            self.model, self.timer.created_at, message, True, finished.reason,
            **self.timer.counters(finished),
        )

    def final(self, finished: Finished) -> bytes:
        if self.reader is None:
            return _line(self.whole("", finished))
        # What the reader held back (a call completed at the end) goes in a chunk of its own.
        rest = self.reader.finish()
        head = _line(s.ChatChunk(self.model, self.timer.created_at, assistant(rest), False)) if rest else b""
        return head + _line(s.ChatChunk(
            self.model, self.timer.created_at, s.AssistantMessage(""), True, finished.reason,
            **self.timer.counters(finished),
        ))


class GenerateLines:
    """The chunks of ``/api/generate``; the last carries ``context`` (prompt and reply token ids)
    for a follow-up request to continue from."""

    def __init__(self, model: str, timer: Timer, prompt_ids: list[int]):
        self.model = model
        self.timer = timer
        self.context = list(prompt_ids)

    def chunk(self, text: str) -> bytes:
        return _line(s.GenerateChunk(self.model, self.timer.created_at, text, False))

    def tokens(self, token_ids: Sequence[int]) -> None:
        self.context.extend(token_ids)

    def whole(self, text: str, token_ids: Sequence[int], finished: Finished) -> s.GenerateChunk:
        self.tokens(token_ids)
        return self._final_chunk(text, finished)

    def final(self, finished: Finished) -> bytes:
        return _line(self._final_chunk("", finished))

    def _final_chunk(self, text: str, finished: Finished) -> s.GenerateChunk:
        return s.GenerateChunk(
            self.model, self.timer.created_at, text, True, finished.reason, self.context,
            **self.timer.counters(finished),
        )


def ndjson_response(ctx: ServerContext, handle: RequestHandle, lines: ChatLines | GenerateLines) -> Stream:
    """A streamed ``application/x-ndjson`` response of ``handle``'s events as ``lines``."""

    async def cancel() -> None:
        handle.cancel()  # in case the stream never started

    return Stream(_lines(ctx, handle, lines), media_type=NDJSON, background=BackgroundTask(cancel))


async def _lines(ctx: ServerContext, handle: RequestHandle, lines: ChatLines | GenerateLines) -> AsyncIterator[bytes]:
    events = tracked_events(ctx, handle)
    try:
        async for event in events:
            if isinstance(event, Delta):
                lines.tokens(event.token_ids)
                if event.text and (line := lines.chunk(event.text)):
                    yield line
            elif isinstance(event, Finished):
                yield error_line(shutdown_cancelled()) if event.reason == "cancelled" else lines.final(event)
            elif isinstance(event, Failed):
                yield error_line(event.error)
    finally:
        await events.aclose()  # cancels the request if the client left mid-stream


def _line(chunk: s.ChatChunk | s.GenerateChunk) -> bytes:
    return s.encoder.encode(chunk) + b"\n"
