"""What every API factory and handler receives: :class:`ServerContext`, and the set of generation
requests in flight it carries (:class:`InflightRequests`), which graceful shutdown waits on
(:func:`mlxr_core.http.server.drain`) and the metrics count.
"""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import time
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from mlxr_core.engine.request import Failed
from mlxr_core.errors import MlxrError, RequestCancelled
from mlxr_core.http.metrics import Metrics, RequestTimer

if TYPE_CHECKING:
    from mlxr_core.config.schema import Config
    from mlxr_core.engine.client import EngineClient
    from mlxr_core.engine.request import RequestHandle
    from mlxr_core.plugins import PluginHost

#: The HTTP request id (``x-request-id``) of the request being served, set by
#: :class:`~mlxr_core.http.access.RequestLog`: generation requests are tracked under it, so an
#: operator can cancel one by id (``POST /v1/requests/{id}/cancel``).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("mlxr_request_id", default=None)
#: The ASGI scope state of the request being served (set beside :data:`REQUEST_ID`), where the key
#: guard later leaves the caller's key owner (:func:`request_owner`).
REQUEST_STATE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("mlxr_request_state", default=None)

#: The scope state key of the caller's API key owner (``mlxr_core.http.access.KEY_OWNER``).
KEY_OWNER = "mlxr.key_owner"


def request_owner() -> str | None:
    """The key owner of the request being served (None where the server has no keys)."""
    state = REQUEST_STATE.get()
    return state.get(KEY_OWNER) if state is not None else None

#: Threads that prepare long bodies at once: many such requests queue for these, not for the
#: worker threads every other request is prepared on.
LONG_BODY_THREADS = 4


class InflightRequests:
    """The generation requests HTTP handlers are serving, for graceful shutdown and metrics.

    Held weakly: a request whose stream never started (the client left before the first byte) is
    forgotten once the engine has ended it and nothing refers to its handle any more. Only touched
    from the server's event loop.
    """

    def __init__(self) -> None:
        self._timers: weakref.WeakKeyDictionary[RequestHandle, RequestTimer | None] = (
            weakref.WeakKeyDictionary()
        )
        #: Set by :func:`mlxr_core.http.server.drain`: new requests are refused with 503.
        self.draining = False
        #: Request ids (the HTTP request's, a background response's) -> the key owner that named
        #: them and their handles (several: the choices of ``n``).
        self._ids: dict[str, tuple[str | None, weakref.WeakSet[RequestHandle]]] = {}

    def __len__(self) -> int:
        return len(self._timers)

    def add(
        self, handle: RequestHandle, timer: RequestTimer | None = None, request_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        self._timers[handle] = timer
        if request_id is not None:
            self.name(handle, request_id, owner)

    def name(self, handle: RequestHandle, request_id: str, owner: str | None = None) -> None:
        """Let ``request_id`` find ``handle`` for ``owner`` (the caller's key owner) alone
        (:meth:`cancel`). An id another owner named keeps pointing at that owner's requests."""
        entry = self._ids.get(request_id)
        if entry is not None and entry[0] != owner and any(h in self._timers for h in entry[1]):
            return
        if entry is None or entry[0] != owner:
            if len(self._ids) >= 4 * max(len(self._timers), 1024):  # forget ids of ended requests
                self._ids = {k: e for k, e in self._ids.items() if any(h in self._timers for h in e[1])}
            entry = self._ids[request_id] = (owner, weakref.WeakSet())
        entry[1].add(handle)

    def cancel(self, request_id: str, owner: str | None = None) -> bool:
        """Cancel the running requests ``owner`` named ``request_id``; whether one was running."""
        entry = self._ids.get(request_id)
        if entry is None or entry[0] != owner:
            return False
        running = [handle for handle in entry[1] if handle in self._timers]
        why = RequestCancelled(f"the request was cancelled by an operator (POST /v1/requests/{request_id[:64]}/cancel)")
        for handle in running:
            handle._emit(Failed(why))  # read before the engine's own end, which tells no reason
            handle.cancel()
        return bool(running)

    def timer(self, handle: RequestHandle) -> RequestTimer | None:
        return self._timers.get(handle)

    def discard(self, handle: RequestHandle) -> None:
        self._timers.pop(handle, None)

    def cancel_all(self) -> int:
        """Cancel every tracked request; the engine ends each with a ``cancelled`` event."""
        handles = list(self._timers)
        for handle in handles:
            handle.cancel()
        return len(handles)

    def fail_all(self, error: MlxrError) -> int:
        """End every tracked request with ``error`` as its last event, without the engine: for an
        engine that no longer answers (stuck in a step, or in a collective with a rank that died).
        An event the engine sends later is never read: a request's consumer stops at its first
        final event."""
        handles = list(self._timers)
        for handle in handles:
            handle._emit(Failed(error))
        return len(handles)

    async def wait_empty(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait up to ``timeout`` seconds for every tracked request to end; True if they did."""
        deadline = time.monotonic() + timeout
        while self._timers:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True


@attrs.define
class ServerContext:
    """What every API factory receives: the config, the plugin host and the engine.

    Factories close over it in their handlers; ``app.state["mlxr"]`` holds it for middleware.
    """

    config: Config
    host: PluginHost
    engine: EngineClient
    #: ``time.time()`` when the server context was made; /health reports the uptime from it.
    started_at: float = attrs.field(factory=time.time)
    #: Plugin name -> its validated ``plugins.config.<name>`` section (an instance of its schema).
    plugin_config: dict[str, Any] = attrs.field(factory=dict)
    #: Generation requests being served (see :mod:`mlxr_core.http.frontend`); drained at shutdown.
    inflight: InflightRequests = attrs.field(factory=InflightRequests)
    #: The worker threads that prepare long bodies (:func:`mlxr_core.http.frontend.prepare_in_thread`).
    long_bodies: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(LONG_BODY_THREADS))
    #: This server's Prometheus metrics.
    metrics: Metrics = attrs.field(init=False)
    #: The engine requests that requests fanning out into many (decisions' rows) hold at once,
    #: together: half of ``engine.max_queue``, so they leave the other half to everyone else.
    fan_out: anyio.CapacityLimiter = attrs.field(init=False)
    #: The transcriptions being served (``engine.max_transcriptions``), taken without waiting.
    transcriptions: anyio.CapacityLimiter = attrs.field(init=False)
    #: The key compaction items are signed with: ``server.compaction_secret``, else random per start.
    compaction_key: bytes = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.fan_out = anyio.CapacityLimiter(max(1, self.config.engine.max_queue // 2))
        self.transcriptions = anyio.CapacityLimiter(self.config.engine.max_transcriptions)
        secret = self.config.server.compaction_secret
        self.compaction_key = secret.encode() if secret else secrets.token_bytes(32)
        inflight = self.inflight
        self.metrics = Metrics(self.engine, inflight=lambda: len(inflight))
