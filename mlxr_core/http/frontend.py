"""What every HTTP API plugin shares: strict body decoding, JSON replies, the engine's readiness,
submission, tracked event streams, and waiting for a whole reply while watching the connection.

A route takes its body typed, as Litestar hands it: ``data: JSONBody[ChatCompletionRequest]``. The
app's request class (:class:`JsonRequest`) decodes it with :func:`decode_body`, so every body is
bounded in depth before msgspec sees it, decoded with strict types (``"5"`` is not an integer) and
refused with a :class:`~mlxr_core.errors.RequestError` naming the field, which the route's API
writes in its own error shape.

An API plugin (OpenAI, Ollama, Anthropic, a third party's) turns its wire format into a
:class:`~mlxr_core.engine.request.GenerationRequest`, then:

    handle = submit(ctx, GenerationRequest(...))       # 503 while draining, engine errors as raised
    async for event in tracked_events(ctx, handle):    # metrics + in-flight tracking
        ...

Every request submitted this way is known to the context's
:class:`~mlxr_core.http.context.InflightRequests`, which is what graceful shutdown waits on
(:func:`mlxr_core.http.server.drain`) and what the metrics count.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import attrs
import msgspec
import numpy as np
from litestar import Request, Response
from litestar.types import Empty

from mlxr_core.engine.request import (
    Delta,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    RequestHandle,
    TokenLogprob,
)
from mlxr_core.errors import EngineStopped, MlxrError, ModelUnavailable, RequestError
from mlxr_core.http.context import REQUEST_ID, ServerContext, request_owner
from mlxr_core.http.metrics import RequestTimer
from mlxr_core.http.offload import offload

if TYPE_CHECKING:
    from mlxr_core.engine.admission import ModelInfo
    from mlxr_core.engine.client import EngineClient

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<field>[^`]+)`")
#: How deep a request body may nest: far beyond any real request (a tool's JSON schema included),
#: far inside the recursion limits of the decoder and of what later walks the values.
MAX_BODY_DEPTH = 100
_JSON = msgspec.json.Encoder()
#: A body longer than this is prepared (templated, tokenized) on the server's few threads for long
#: bodies (:attr:`~mlxr_core.http.context.ServerContext.long_bodies`): a real chat is far shorter.
LONG_BODY_BYTES = 128 * 1024


class ClientDisconnected(MlxrError):
    """The client went away before its reply was ready; nobody reads the response."""

    status = 499


def decode_body(body: bytes, schema: type[T]) -> T:
    """Decode a JSON request body into ``schema`` (msgspec, strict types), turning every failure
    into a :class:`RequestError` whose ``param`` names the field (``messages[0].role``)."""
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    if body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH and body_depth(body) > MAX_BODY_DEPTH:
        raise RequestError(f"the request body nests arrays and objects deeper than {MAX_BODY_DEPTH}")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        if "got `float`" in str(exc):
            try:
                return msgspec.convert(_integers(msgspec.json.decode(body)), schema, strict=True)
            except msgspec.ValidationError:
                pass
        raise RequestError(f"invalid request: {exc}", field=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise RequestError(
            f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except RecursionError:  # a deep body on a deep stack: body_depth is the bound, this a backstop
        raise RequestError("the request body nests arrays and objects too deeply") from None


def _integers(value: Any) -> Any:
    """``value`` with every number that has no fraction (``5.0``) made an integer: JSON Schema's
    ``"type": "integer"``, which the document states, counts ``5.0`` as one, and msgspec's strict
    decoder does not. Only a body the decoder refused is read again this way."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_integers(item) for item in value]
    if isinstance(value, dict):
        return {key: _integers(item) for key, item in value.items()}
    return value


class JsonRequest(Request[Any, Any, Any]):
    """The app's request class: :meth:`json` decodes the body with :func:`decode_body` into the type
    of the route's ``data`` parameter, as declared (``Annotated`` constraints included; any JSON
    value where the route has none)."""

    async def json(self) -> Any:
        if self._json is Empty:
            data = self.route_handler.parsed_data_field
            schema = Any if data is None else data.raw
            body = await self.body()
            try:
                self._json = decode_body(body, schema)
            except RequestError as exc:
                model = default_model(self.app.state["mlxr"]) if _missing_model(exc) else None
                if model is None:
                    raise
                self._json = decode_body(with_model(body, model), schema)
        return self._json


def default_model(ctx: ServerContext) -> str | None:
    """The model a request that names none goes to: ``server.default_model``, or with
    ``server.model_optional`` the one model served; None: such a request is refused."""
    server = ctx.config.server
    if server.default_model:
        return server.default_model
    models = getattr(ctx.engine, "served", [])
    return next(iter(models)) if server.model_optional and len(models) == 1 else None


def with_model(body: bytes, model: str) -> bytes:
    """A JSON object ``body`` with ``"model": model`` added, or put in place of ``"model": null``
    (a body that is no object as it is)."""
    text = body.lstrip()
    if not text.startswith(b"{"):
        return body
    rest = text[1:].lstrip()
    if b'"model"' in rest:  # null as the decoder found it: the object read again, model set
        data = msgspec.json.decode(body)
        return _JSON.encode({**data, "model": model}) if isinstance(data, dict) else body
    return b'{"model":' + _JSON.encode(model) + (b"" if rest.startswith(b"}") else b",") + rest


def _missing_model(exc: RequestError) -> bool:
    """The model is absent, or null (which clients send for "the default" as llama.cpp's server
    takes it)."""
    return exc.field == "model" and ("missing required field" in exc.message or "got `null`" in exc.message)


def body_depth(body: bytes) -> int:
    """How deep a JSON text's arrays and objects nest, brackets inside strings not counted: a few
    vectorized passes, in bounded time and memory, before anything recurses into it."""
    # Escape pairs out first (left to right, as JSON pairs them); strings then run quote to quote.
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = (np.cumsum(text == ord('"'), dtype=np.uint8) & 1) == 0  # wraps at 256, keeps parity
    opens = ((text == ord("[")) | (text == ord("{"))) & outside
    closes = ((text == ord("]")) | (text == ord("}"))) & outside
    steps = (opens.astype(np.int8) - closes.astype(np.int8))[opens | closes]
    deepest = depth = 0
    for start in range(0, len(steps), 1 << 20):  # int64 running depths, a chunk at a time
        running = np.cumsum(steps[start : start + (1 << 20)], dtype=np.int64) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _param_of(message: str) -> str | None:
    """``messages[0].role`` from msgspec's "... - at `$.messages[0]`" and "missing (or unknown)
    field `role`"."""
    match = _PATH.search(message)
    path = match["path"] if match else ""
    named = _NAMED.match(message)
    if named:
        path = f"{path}.{named['field']}" if path else named["field"]
    return path or None


def json_response(value: Any) -> Response[bytes]:
    """A 200 reply of ``value`` (msgspec structs, dicts, lists ...) encoded as JSON."""
    return Response(_JSON.encode(value), media_type="application/json")


def ready_engine(ctx: ServerContext) -> EngineClient:
    """The engine, or :class:`EngineStopped` (503) while it loads, failed, stops or the server drains."""
    engine = ctx.engine
    state = engine.state
    if ctx.inflight.draining or state in ("stopping", "stopped"):
        raise EngineStopped("the server is shutting down")
    if state == "ready":
        return engine
    if state in ("created", "loading"):
        raise EngineStopped("the model is still loading; retry shortly")
    raise EngineStopped(f"the model failed to load: {engine.error}")


async def loaded_model(ctx: ServerContext, name: str) -> ModelInfo:
    """The served model ``name`` (a name or an alias) names, loaded: a model not loaded yet (lazy,
    unloaded for idleness or room) is loaded first while the request waits, at most
    ``engine.model_load_wait_s`` seconds (then :class:`ModelUnavailable`, 503, as for a model that
    failed to load: see :mod:`mlxr_core.engine.lifecycle`). Raises :class:`ModelNotFound` too."""
    engine = ready_engine(ctx)
    future = engine.ensure_loaded(name)
    if not future.done():
        bound = ctx.config.engine.model_load_wait_s
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), bound)
        except TimeoutError:
            served = engine.resolve(name)
            raise ModelUnavailable(
                f"model {served!r} is still loading after {bound:g}s (engine.model_load_wait_s); retry later"
            ) from None
    future.result()  # its load's error, if it failed
    return engine.model(name)


async def prepare_in_thread(ctx: ServerContext, request: Request[Any, Any, Any], work: Callable[[], T]) -> T:
    """``work()`` (a prompt's templating and tokenizing) in a worker thread; a long body's on the
    server's few threads for long bodies, so that however many come, they wait for each other while
    every other request keeps the shared worker threads. A daemon thread that a shutdown abandons
    (:func:`~mlxr_core.http.offload.offload`): the request ends with a 503 as the drain begins."""
    long = len(await request.body()) > LONG_BODY_BYTES  # read already: the handler's typed body
    return await offload(work, limiter=ctx.long_bodies if long else None)


def cap_max_tokens(ctx: ServerContext, requested: int | None) -> int | None:
    """``requested`` lowered to ``server.max_tokens_cap``; None (the engine's default) becomes the
    cap when the default would exceed it."""
    cap = ctx.config.server.max_tokens_cap
    if cap is None:
        return requested
    if requested is None:
        return min(cap, ctx.config.engine.default_max_tokens)
    return min(requested, cap)


def room_for(engine: EngineClient, model: str, prompt_ids: list[int], requested: int | None) -> int | None:
    """``requested`` clamped to the context left after the prompt, for APIs whose ``max_tokens`` is
    an upper bound rather than a promise (Anthropic, Ollama). A prompt that fills the context is
    left to the engine, which refuses it naming the context length."""
    if requested is None:
        return None
    room = engine.model(model).context_length - len(prompt_ids)
    return max(1, min(requested, room))


def submit(ctx: ServerContext, request: GenerationRequest) -> RequestHandle:
    """Hand ``request`` to the engine for the calling event loop and track it until its last event.

    Raises what :meth:`Engine.submit` raises, and :class:`EngineStopped` while the server drains.
    """
    engine = ready_engine(ctx)
    handle = engine.submit(request, loop=asyncio.get_running_loop())
    ctx.inflight.add(handle, RequestTimer(ctx.metrics, request.model), REQUEST_ID.get(), request_owner())
    return handle


async def tracked_events(ctx: ServerContext, handle: RequestHandle) -> AsyncGenerator[Event, None]:
    """``handle``'s events, timed for the metrics; the request is cancelled if the consumer stops
    early (a client that left) and forgotten by the in-flight set once its last event is read."""
    timer = ctx.inflight.timer(handle)
    finished = False
    try:
        async for event in handle.events():
            if timer is not None:
                if isinstance(event, Delta):
                    timer.tokens(len(event.token_ids))
                elif isinstance(event, Finished):
                    usage = event.usage
                    timer.finished(event.reason, usage.prompt_tokens, usage.completion_tokens)
                else:
                    timer.finished("error", None, None)
            finished = not isinstance(event, Delta)
            yield event
    finally:
        if not finished:
            handle.cancel()  # frees the engine's slot when the client left mid-stream
            if timer is not None:
                timer.finished("cancelled", None, None)
        ctx.inflight.discard(handle)


@attrs.frozen
class Reply:
    """A whole generated reply."""

    text: str
    token_ids: list[int]
    finished: Finished
    #: One entry per token when the request asked for logprobs.
    logprobs: list[TokenLogprob] = attrs.field(factory=list)


async def collect(ctx: ServerContext, handle: RequestHandle, request: Request[Any, Any, Any]) -> Reply:
    """Wait for the whole reply; cancel the request if the client disconnects meanwhile.

    Raises the request's error if it failed, :class:`EngineStopped` if it was cancelled by a
    shutdown, and :class:`ClientDisconnected` if the client left.
    """
    parts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    last: Finished | Failed | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(_cancel_on_disconnect, request, handle, group.cancel_scope)
        async with aclosing(tracked_events(ctx, handle)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    parts.append(event.text)
                    token_ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                else:
                    last = event
        group.cancel_scope.cancel()
    if last is None:
        raise ClientDisconnected("the client disconnected")
    if isinstance(last, Failed):
        raise last.error
    if last.reason == "cancelled":
        raise shutdown_cancelled()
    return Reply("".join(parts), token_ids, last, logprobs)


async def unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (an engine job
    stops before its next part) and :class:`ClientDisconnected` raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected("the client disconnected")
    finally:
        for pending in (task, watch):
            pending.cancel()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def shutdown_cancelled() -> EngineStopped:
    """Why a request whose client still waits was cancelled: only a shutdown does that."""
    return EngineStopped("the request was cancelled: the server is shutting down")


async def _cancel_on_disconnect(
    request: Request[Any, Any, Any], handle: RequestHandle, scope: anyio.CancelScope
) -> None:
    await _disconnected(request)
    handle.cancel()
    scope.cancel()
