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
- ``body_timeout``: seconds a request has to send its whole body once its head is in;
- ``body_min_rate``: bytes per second a body must keep up once its head is in, after a grace of
  ``header_timeout`` (Apache's ``mod_reqtimeout`` ``MinRate``): a body of ``n`` bytes so far is
  closed once it has taken longer than ``header_timeout + n / body_min_rate`` seconds. Time the
  server itself stops reading (its handler has not taken the bytes already in) does not count.

A connection past any of them is closed; an upload is first answered ``408``. A handler waiting for
its body sees the client disconnect. A request whose body is in is never timed out here, however
long its response takes.

Within the deadlines, many connections could still hold every file descriptor the process may
open (300 idle sockets under a 256-file limit, 250 bodies trickling a byte every 2 s).
``max_connections`` is a budget: a connection beyond it closes the connection that has waited
longest for a request head, else the upload furthest behind the minimum rate, so new clients and
``/health`` keep getting in; when neither exists (all are running requests), the new one is closed.
Uploads may hold at most the budget less a reserve of an eighth (:func:`upload_reserve`): one more
closes the upload furthest behind. :func:`connection_budget` derives the default from the
process's file limit.

When the process is out of file descriptors anyway, asyncio logs a traceback for every failed
``accept()``, thousands a second; :class:`AcceptErrorLog` says it once per interval, with a count.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

#: File descriptors kept out of the connection budget: model files, logs, the listening socket,
#: the engine's and the runtime's own.
RESERVED_FDS = 64
#: Bytes per second uploads are ranked against when ``body_min_rate`` is 0 (no rate enforced):
#: the budget still sheds the upload furthest behind it first.
RANKING_RATE = 500.0
#: Seconds between two log lines about failed ``accept()`` calls.
ACCEPT_ERROR_INTERVAL_S = 10.0
#: What ``accept()`` fails with when the process (or the system) is out of descriptors or memory.
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

log = logging.getLogger(__name__)


def connection_budget(reserved: int = RESERVED_FDS) -> int:
    """Connections the process's file limit (``RLIMIT_NOFILE``, soft) leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - reserved)


def upload_reserve(budget: int) -> int:
    """Connections of ``budget`` that request bodies in progress may not hold, kept for new clients
    and ``/health``: an eighth, at least one (none of a budget of one)."""
    return min(budget - 1, max(1, budget // 8))


@functools.cache
def protocol_with_deadlines(
    header_timeout: float,
    body_timeout: float,
    max_connections: int | None = None,
    body_min_rate: float = 500.0,
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the read deadlines, the minimum body rate and the connection
    budget (defined on first use: uvicorn is imported only when serving)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # A connection is looked at this often; a deadline is met within this much of its time.
    every = min(header_timeout, body_timeout) / 4

    budget = max_connections or connection_budget()
    max_uploads = budget - upload_reserve(budget)
    rate = body_min_rate or RANKING_RATE

    class DeadlineProtocol(H11Protocol):
        """H11Protocol, closing a connection that misses a read deadline or is past the budget."""

        _watch: asyncio.TimerHandle | None = None
        #: The open connections (one event loop serves them all), and those receiving a body.
        live: set[DeadlineProtocol] = set()
        uploads: set[DeadlineProtocol] = set()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            now = self.loop.time()
            self._waiting_since: float | None = now
            self._body_since: float | None = None
            self._received = 0  # bytes, on this connection
            self._body_from = 0  # _received when the body began
            self._paused_s = 0.0  # seconds of the body during which the server was not reading
            self._checked_at = now
            self._watch = self.loop.call_later(every, self._check_deadlines)
            self.live.add(self)
            if len(self.live) > budget:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self.live.discard(self)
            self.uploads.discard(self)
            if self._watch is not None:
                self._watch.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._received += len(data)
            super().data_received(data)
            self._track_body()

        def _idle(self) -> bool:
            """Waiting for a request head: none started, or the previous response has ended."""
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _track_body(self) -> None:
            """Note a body starting or ending; one upload past their share of the budget sheds the
            one furthest behind (perhaps itself)."""
            receiving = self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing()
            if receiving and self._body_since is None:
                self._body_since, self._body_from, self._paused_s = self.loop.time(), self._received, 0.0
                self.uploads.add(self)
                if len(self.uploads) > max_uploads:
                    now = self.loop.time()
                    min(self.uploads, key=lambda c: c._slack(now))._shed("server.max_connections")
            elif not receiving and self._body_since is not None:
                self._body_since = None
                self.uploads.discard(self)

        def _slack(self, now: float) -> float:
            """Seconds this body is ahead of the minimum rate (``header_timeout`` to begin with,
            plus one for every ``rate`` bytes in); negative once behind it."""
            if self._body_since is None:
                return float("inf")
            seconds = now - self._body_since - self._paused_s
            return header_timeout + (self._received - self._body_from) / rate - seconds

        def _make_room(self) -> None:
            """Close the other connection idle the longest, else the upload furthest behind the
            minimum rate, else this one."""
            idle = [c for c in self.live if c is not self and c._idle() and c._waiting_since is not None]
            if idle:
                oldest = min(idle, key=lambda c: c._waiting_since or 0.0)
                self.live.discard(oldest)
                oldest.transport.close()
            elif self.uploads:
                now = self.loop.time()
                min(self.uploads, key=lambda c: c._slack(now))._shed("server.max_connections")
            else:
                self.live.discard(self)
                self.transport.close()

        def _shed(self, setting: str) -> None:
            """Close this upload; answer it 408 naming ``setting`` first if no response has started."""
            self.live.discard(self)
            self.uploads.discard(self)
            if self.cycle is not None and not self.cycle.response_started and not self.transport.is_closing():
                self.transport.write(_request_timeout(setting))
                self.cycle.disconnected = True  # the handler's own answer, if any, is not sent
            self.transport.close()  # connection_lost follows: a handler sees a disconnect

        def _check_deadlines(self) -> None:
            now = self.loop.time()
            if self._body_since is not None and self.flow.read_paused:
                self._paused_s += now - max(self._checked_at, self._body_since)  # the server's own backpressure
            self._checked_at = now
            self._track_body()
            waiting = self._idle()
            self._waiting_since = (self._waiting_since or now) if waiting else None
            late_head = self._waiting_since is not None and now - self._waiting_since >= header_timeout
            late_body = self._body_since is not None and now - self._body_since >= body_timeout
            slow_body = body_min_rate > 0 and self._slack(now) < 0
            if late_head or late_body or slow_body:
                self._watch = None
                if late_head:
                    self.transport.close()  # connection_lost follows
                else:
                    self._shed("server.body_timeout" if late_body else "server.body_min_rate")
                return
            self._watch = self.loop.call_later(every, self._check_deadlines)

    return DeadlineProtocol


def _request_timeout(setting: str) -> bytes:
    """A whole ``408`` response (the connection closes after it), in a neutral JSON shape."""
    reasons = {
        "server.body_timeout": "the request body did not arrive within server.body_timeout",
        "server.body_min_rate": "the request body arrived slower than server.body_min_rate bytes per second",
        "server.max_connections": (
            "the server is at server.max_connections and closed the slowest request body to let "
            "others in"
        ),
    }
    body = json.dumps({"error": f"{reasons[setting]}; send it faster, or retry"}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class AcceptErrorLog(logging.Filter):
    """On the ``asyncio`` logger: the event loop's failed ``accept()`` calls said once per
    ``interval`` on this module's logger (mlxr's format and level), without their traceback and
    counting the ones held back; other records pass untouched.

    Out of file descriptors, asyncio logs a traceback for each failed ``accept()`` and tries again
    up to the listening backlog (uvicorn's 2,048) at a time: thousands of lines a second, which
    bury everything else.
    """

    def __init__(self, interval: float = ACCEPT_ERROR_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._said_at: float | None = None
        self._held_back = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, OSError) or exc.errno not in _OUT_OF_RESOURCES:
            return True
        now = self.clock()
        if self._said_at is not None and now - self._said_at < self.interval:
            self._held_back += 1
            return False
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        more = f" ({self._held_back} more in the last {now - self._said_at:.0f} s)" if self._said_at is not None else ""
        log.error(
            "cannot accept connections: %s (%s); the process may open %s files (ulimit -n): raise it, "
            "or lower server.max_connections%s",
            exc.strerror or exc, errno.errorcode.get(exc.errno or 0, exc.errno), soft, more,
        )
        self._said_at, self._held_back = now, 0
        return False


def quiet_accept_errors(interval: float = ACCEPT_ERROR_INTERVAL_S) -> None:
    """Put :class:`AcceptErrorLog` on the ``asyncio`` logger, once."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(each, AcceptErrorLog) for each in logger.filters):
        logger.addFilter(AcceptErrorLog(interval))
