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
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any


@functools.cache
def protocol_with_deadlines(header_timeout: float, body_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the two read deadlines (defined on first use: uvicorn is
    imported only when serving)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # A connection is looked at this often; a deadline is met within this much of its time.
    every = min(header_timeout, body_timeout) / 4

    class DeadlineProtocol(H11Protocol):
        """H11Protocol, closing a connection that misses a read deadline."""

        _watch: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._waiting_since: float | None = self.loop.time()
            self._body_since: float | None = None
            self._watch = self.loop.call_later(every, self._check_deadlines)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._watch is not None:
                self._watch.cancel()
            super().connection_lost(exc)

        def _check_deadlines(self) -> None:
            now, state = self.loop.time(), self.conn.their_state
            # Waiting for a request head: none started, or the previous response has ended.
            waiting = state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
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
