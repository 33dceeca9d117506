"""Engine events -> OpenAI responses: one JSON body, or server-sent events.

A client that goes away cancels its request, whichever way it leaves:

- streaming: the SSE generator cancels in ``finally``. Litestar only stops iterating when the
  client disconnects (litestar#3772), so the producer must stop its own work; the response's
  background task cancels again in case the generator was parked at a ``yield`` and is never
  resumed;
- non-streaming: :func:`mlxr_core.http.frontend.collect` watches the connection while it waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs
import msgspec
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from mlxr_core.chat.parsing import Text, ToolCall
from mlxr_core.chat.tools import ReplyReader
from mlxr_core.engine.request import Delta, Event, Failed, Finished, RequestHandle, TokenLogprob
from mlxr_core.engine.request import Usage as EngineUsage
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import shutdown_cancelled, tracked_events
from mlxr_plugins.apis.openai import schemas as s
from mlxr_plugins.apis.openai.errors import error_body
from mlxr_plugins.apis.openai.logprobs import LogprobFormatter
from mlxr_plugins.apis.openai.tools import deltas

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


@attrs.frozen
class ResponseMeta:
    """What every response or chunk of one request repeats."""

    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))


def usage_of(usage: EngineUsage, *, predicted: bool = False, reasoning_tokens: int | None = None) -> s.Usage:
    """The API's usage; ``predicted``: the request brought a ``prediction``, whose accepted and
    rejected tokens are then reported (zeros included, as OpenAI does); ``reasoning_tokens``: the
    model reasons, and this many of the completion's tokens were its reasoning."""
    details = s.PromptTokensDetails(usage.cached_tokens)
    accepted, rejected = usage.accepted_prediction_tokens, usage.rejected_prediction_tokens
    completion: Any = msgspec.UNSET
    if predicted or accepted or rejected or reasoning_tokens is not None:
        reasoning = min(reasoning_tokens or 0, usage.completion_tokens)
        completion = s.CompletionTokensDetails(accepted, rejected, reasoning)
    return s.Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, details, completion)


@attrs.define
class ReasoningCount:
    """The reasoning a request's choices stream, counted in tokens for its usage (each choice's
    text re-encoded by ``encode``, as the non-streamed reply counts it)."""

    encode: Callable[[str], list[int]]
    texts: dict[int, list[str]] = attrs.field(factory=dict)

    def add(self, index: int, text: str) -> None:
        self.texts.setdefault(index, []).append(text)

    def tokens(self) -> int:
        return sum(len(self.encode("".join(parts))) for parts in self.texts.values())


def total_usage(usages: list[EngineUsage]) -> EngineUsage:
    """Several choices' usage: OpenAI counts the prompt once (as much of it cached as the first
    choice found) and every choice's completion tokens."""
    first = usages[0]
    return EngineUsage(
        first.prompt_tokens,
        sum(u.completion_tokens for u in usages),
        first.cached_tokens,
        accepted_prediction_tokens=sum(u.accepted_prediction_tokens for u in usages),
        rejected_prediction_tokens=sum(u.rejected_prediction_tokens for u in usages),
    )


class ChatChunks:
    """The SSE chunks of one choice of a chat completion; with a ``reader``, the text is split into
    reasoning, content and tool calls as it streams; with ``logprobs``, each token's logprob rides
    on the chunk its text produced (a chunk with an empty delta where the text is held back)."""

    def __init__(
        self,
        meta: ResponseMeta,
        include_usage: bool,
        reader: ReplyReader | None = None,
        *,
        index: int = 0,
        logprobs: LogprobFormatter | None = None,
        predicted: bool = False,
        reasoning: ReasoningCount | None = None,
    ):
        self.meta = meta
        self.include_usage = include_usage
        self.reader = reader
        self.index = index
        self.logprobs = logprobs
        #: The request brought a ``prediction`` (see :func:`usage_of`).
        self.predicted = predicted
        #: Where the model reasons: its reasoning, shared by the request's choices, for usage.
        self.reasoning = reasoning

    def _chunk(self, choices: list[s.ChatChunkChoice], usage: s.Usage | None = None) -> bytes:
        m = self.meta
        field: Any = usage if self.include_usage else msgspec.UNSET
        return sse_event(s.encoder.encode(s.ChatCompletionChunk(m.id, m.created, m.model, choices, usage=field)))

    def first(self) -> bytes | None:
        return self._chunk([s.ChatChunkChoice(self.index, s.ChatDelta(role="assistant", content=""))])

    def text(self, text: str, entries: Sequence[TokenLogprob] = ()) -> bytes:
        logprobs = self.logprobs.chat(entries) if self.logprobs is not None and entries else None
        if self.reader is None:
            return self._chunk([s.ChatChunkChoice(self.index, s.ChatDelta(content=text), logprobs=logprobs)])
        return self._pieces(self._deltas(self.reader.feed(text)), logprobs)

    def _pieces(self, found: list[s.ChatDelta], logprobs: s.ChatLogprobs | None) -> bytes:
        """A chunk per delta, the tokens' logprobs on the first (an empty one if there is none)."""
        if not found and logprobs is not None:
            found = [s.ChatDelta()]
        return b"".join(
            self._chunk([s.ChatChunkChoice(self.index, delta, logprobs=logprobs if i == 0 else None)])
            for i, delta in enumerate(found)
        )

    def finish(self, reason: str) -> bytes:
        head = b""
        if self.reader is not None:
            head = b"".join(
                self._chunk([s.ChatChunkChoice(self.index, delta)]) for delta in self._deltas(self.reader.finish())
            )
            reason = self.reader.finish_reason(reason)
        return head + self._chunk([s.ChatChunkChoice(self.index, s.ChatDelta(), finish_reason=reason)])

    def _deltas(self, pieces: list[Text | ToolCall], first_call: int | None = None) -> list[s.ChatDelta]:
        """``pieces`` as deltas, their calls numbered from ``first_call`` (None: as the reader counts)."""
        if first_call is None:
            assert self.reader is not None
            first_call = self.reader.calls - sum(isinstance(piece, ToolCall) for piece in pieces)
        if self.reasoning is not None:
            for piece in pieces:
                if isinstance(piece, Text) and piece.kind == "reasoning":
                    self.reasoning.add(self.index, piece.text)
        return deltas(pieces, first_call)

    def usage(self, usage: EngineUsage) -> bytes | None:
        if not self.include_usage:
            return None
        reasoning = self.reasoning.tokens() if self.reasoning is not None else None
        return self._chunk([], usage_of(usage, predicted=self.predicted, reasoning_tokens=reasoning))


class CompletionChunks:
    """The SSE chunks of one choice of a text completion."""

    def __init__(
        self,
        meta: ResponseMeta,
        include_usage: bool,
        *,
        index: int = 0,
        logprobs: LogprobFormatter | None = None,
    ):
        self.meta = meta
        self.include_usage = include_usage
        self.index = index
        self.logprobs = logprobs
        #: Characters of token text sent so far (``text_offset`` of the next token).
        self.offset = 0

    def _chunk(self, choices: list[s.CompletionChoice], usage: s.Usage | None = None) -> bytes:
        m = self.meta
        field: Any = usage if self.include_usage else msgspec.UNSET
        return sse_event(s.encoder.encode(s.Completion(m.id, m.created, m.model, choices, usage=field)))

    def first(self) -> bytes | None:
        return None

    def text(self, text: str, entries: Sequence[TokenLogprob] = ()) -> bytes:
        logprobs = None
        if self.logprobs is not None and entries:
            logprobs = self.logprobs.completion(entries, self.offset)
            self.offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return self._chunk([s.CompletionChoice(self.index, text, logprobs=logprobs)])

    def finish(self, reason: str) -> bytes:
        return self._chunk([s.CompletionChoice(self.index, "", finish_reason=reason)])

    def usage(self, usage: EngineUsage) -> bytes | None:
        return self._chunk([], usage_of(usage)) if self.include_usage else None


Chunks = ChatChunks | CompletionChunks


def sse_response(
    ctx: ServerContext, handles: RequestHandle | list[RequestHandle], chunks: Chunks | Sequence[Chunks]
) -> Stream:
    """A ``text/event-stream`` response streaming each handle's events as its choice's chunks
    (``handles[i]`` is choice ``i``), in the order they come."""
    handles = handles if isinstance(handles, list) else [handles]
    chunks = [chunks] if isinstance(chunks, (ChatChunks, CompletionChunks)) else list(chunks)

    async def cancel() -> None:
        for handle in handles:
            handle.cancel()

    if len(handles) == 1:
        events = _events(ctx, handles[0], chunks[0])
    else:
        events = _merged_events(ctx, handles, chunks)
    return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(cancel))


def _event_chunks(chunks: Chunks, event: Event) -> bytes:
    """The chunks one engine event makes (a ``Finished`` makes the finish chunk only)."""
    if isinstance(event, Delta):
        if event.text or event.logprobs:
            return chunks.text(event.text, event.logprobs)
        return b""
    if isinstance(event, Finished):
        if event.reason == "cancelled":
            return sse_event(error_body(shutdown_cancelled()))
        return chunks.finish(event.reason)
    assert isinstance(event, Failed)
    # Headers are sent: the error travels as an event, which OpenAI clients raise.
    return sse_event(error_body(event.error))


async def _events(ctx: ServerContext, handle: RequestHandle, chunks: Chunks) -> AsyncIterator[bytes]:
    events = tracked_events(ctx, handle)
    try:
        first = chunks.first()
        if first is not None:
            yield first
        async for event in events:
            data = _event_chunks(chunks, event)
            if data:
                yield data
            if isinstance(event, Finished):
                if event.reason == "cancelled":
                    break
                usage = chunks.usage(event.usage)
                if usage is not None:
                    yield usage
        yield DONE
    finally:
        await events.aclose()  # cancels the request if the client left mid-stream


async def _merged_events(
    ctx: ServerContext, handles: list[RequestHandle], chunks: Sequence[Chunks]
) -> AsyncIterator[bytes]:
    """Several choices' events interleaved as they arrive; one usage chunk (the choices' tokens
    summed, the prompt once) after the last choice finishes."""
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        events = tracked_events(ctx, handles[index])
        try:
            async for event in events:
                await queue.put((index, event))
        finally:
            await events.aclose()
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(handles))]
    try:
        for c in chunks:
            first = c.first()
            if first is not None:
                yield first
        open_choices, usages, failed = len(handles), [], False
        while open_choices:
            index, event = await queue.get()
            if event is None:
                open_choices -= 1
                continue
            data = _event_chunks(chunks[index], event)
            if data:
                yield data
            if isinstance(event, Finished) and event.reason != "cancelled":
                usages.append(event.usage)
            elif not isinstance(event, Delta):
                failed = True
        if usages and not failed:
            usage = chunks[0].usage(total_usage(usages))
            if usage is not None:
                yield usage
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
