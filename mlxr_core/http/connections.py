"""Read deadlines for the server's connections: uvicorn's h11 protocol, closing a connection that
sends nothing, or a request's head or body too slowly.

uvicorn times out a connection only between requests (``timeout_keep_alive``, armed after a
response). A connection that never sends a request, or sends its head a byte at a time
(slow-loris), or stops halfway through its body, would otherwise stay open for ever, holding a
file descriptor (and, for a body, a handler) until the process runs out of them and no client,
``/health`` included, gets in. :func:`protocol_with_deadlines` is the protocol class ``mlxr serve``
gives uvicorn (``uvicorn.Config(http=...)``):

- ``header_timeout``: seconds a connection has to send a whole request head, counted from when it
  connected or from its previous response;
- ``body_timeout``: seconds a request has to send its whole body once its head is in.

A connection past either is closed; a handler waiting for its body sees the client disconnect. A
request whose body is in is never timed out here, however long its response takes.

Within the deadlines, many connections could still hold every file descriptor the process may
open (300 idle sockets under a 256-file limit). ``max_connections`` is a budget: a connection
beyond it closes the connection that has waited longest for a request head, so new clients and
``/health`` keep getting in; when none waits (all are running requests), the new one is closed.
:func:`connection_budget` derives the default from the process's file limit.
"""

from __future__ import annotations

import asyncio
import functools
import resource
from typing import Any

#: File descriptors kept out of the connection budget: model files, logs, the listening socket,
#: the engine's and the runtime's own.
RESERVED_FDS = 64


def connection_budget(reserved: int = RESERVED_FDS) -> int:
    """Connections the process's file limit (``RLIMIT_NOFILE``, soft) leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - reserved)


@functools.cache
def protocol_with_deadlines(
    header_timeout: float, body_timeout: float, max_connections: int | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the two read deadlines and the connection budget (defined on
    first use: uvicorn is imported only when serving)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # A connection is looked at this often; a deadline is met within this much of its time.
    every = min(header_timeout, body_timeout) / 4

    budget = max_connections or connection_budget()

    class DeadlineProtocol(H11Protocol):
        """H11Protocol, closing a connection that misses a read deadline or is past the budget."""

        _watch: asyncio.TimerHandle | None = None
        #: The open connections (one event loop serves them all).
        live: set[DeadlineProtocol] = set()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._waiting_since: float | None = self.loop.time()
            self._body_since: float | None = None
            self._watch = self.loop.call_later(every, self._check_deadlines)
            self.live.add(self)
            if len(self.live) > budget:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self.live.discard(self)
            if self._watch is not None:
                self._watch.cancel()
            super().connection_lost(exc)

        def _idle(self) -> bool:
            """Waiting for a request head: none started, or the previous response has ended."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _make_room(self) -> None:
            """Close the other connection idle the longest, else this one."""
            idle = [c for c in self.live if c is not self and c._idle() and c._waiting_since is not None]
            oldest = min(idle, key=lambda c: c._waiting_since or 0.0, default=self)
            self.live.discard(oldest)
            oldest.transport.close()

        def _check_deadlines(self) -> None:
            now, state = self.loop.time(), self.conn.their_state
            waiting = self._idle()
            self._waiting_since = (self._waiting_since or now) if waiting else None
            self._body_since = (self._body_since or now) if state is h11.SEND_BODY else None
            late_head = self._waiting_since is not None and now - self._waiting_since >= header_timeout
            late_body = self._body_since is not None and now - self._body_since >= body_timeout
            if late_head or late_body:
                self._watch = None
                self.transport.close()  # connection_lost follows: a handler sees a disconnect
                return
            self._watch = self.loop.call_later(every, self._check_deadlines)

    return DeadlineProtocol
