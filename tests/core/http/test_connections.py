"""Slow request bodies against the connection budget (``mlxr_core.http.connections``), on a real
uvicorn with ``mlxr serve``'s settings, and the rate-limited log of a process out of files."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from litestar import Litestar, Request, get, post

from mlxr_core.cli import serve
from mlxr_core.config.schema import ServerConfig
from mlxr_core.http.connections import AcceptErrorLog


@get("/health", sync_to_thread=False)
def health() -> dict[str, str]:
    return {"status": "ok"}


@post("/upload", status_code=200)
async def upload(request: Request[Any, Any, Any]) -> dict[str, int]:
    return {"bytes": len(await request.body())}


@contextmanager
def running(settings: ServerConfig) -> Iterator[int]:
    """uvicorn with ``mlxr serve``'s settings around ``/health`` and ``POST /upload``; yields the port."""
    import uvicorn

    server = uvicorn.Server(serve.uvicorn_config(Litestar([health, upload], logging_config=None), settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


class Upload:
    """A ``POST /upload`` of ``length`` bytes sent ``chunk`` bytes every ``every`` seconds on its own
    thread; ``answer`` is what the server sent back ("" if it closed without a word), ``ended_after``
    the seconds until the exchange ended."""

    def __init__(self, port: int, length: int, chunk: int, every: float):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(
            f"POST /upload HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
        )
        self.length, self.chunk, self.every = length, chunk, every
        self.answer = ""
        self.ended_after: float | None = None
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def _send(self) -> None:
        started, sent = time.monotonic(), 0
        self.sock.settimeout(self.every)
        try:
            while sent < self.length:
                self.sock.sendall(b"x" * min(self.chunk, self.length - sent))
                sent += self.chunk
                with contextlib.suppress(TimeoutError):
                    self.answer = self.sock.recv(4096).decode(errors="replace")
                    break  # answered (or closed) before the body was all sent
            self.sock.settimeout(10)
            while not self._complete() and (data := self.sock.recv(4096)):
                self.answer += data.decode(errors="replace")
        except OSError:
            pass
        self.ended_after = time.monotonic() - started
        self.sock.close()

    def _complete(self) -> bool:
        head, _, body = self.answer.partition("\r\n\r\n")
        length = re.search(r"content-length: (\d+)", head, re.IGNORECASE)
        return length is not None and len(body) >= int(length[1])

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)


def health_latencies(port: int, count: int, every: float) -> list[float | None]:
    """``GET /health`` on a new connection ``count`` times: seconds to each 200, None if refused."""
    latencies: list[float | None] = []
    for _ in range(count):
        started = time.monotonic()
        try:
            ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        latencies.append(time.monotonic() - started if ok else None)
        time.sleep(every)
    return latencies


def test_slow_uploads_past_the_budget_are_shed_slowest_first_and_health_keeps_answering() -> None:
    """N6 at a small scale: 30 uploads trickling a byte every 0.5 s and 4 steady ones against a
    budget of 16 connections, with the minimum body rate off and a 30 s body timeout (so neither
    deadline is what lets clients in): ``/health`` answers throughout, the steady uploads finish."""
    settings = ServerConfig(port=0, header_timeout=0.5, body_timeout=30.0, body_min_rate=0.0, max_connections=16)
    with running(settings) as port:
        steady = [Upload(port, 40_000, 2_000, 0.1) for _ in range(4)]
        trickling = []
        for _ in range(30):
            trickling.append(Upload(port, 100_000, 1, 0.5))
            time.sleep(0.01)
        latencies = health_latencies(port, 10, 0.2)
        for each in steady:
            each.wait(10)
        assert None not in latencies, latencies
        assert all(each.answer.startswith("HTTP/1.1 200") and '"bytes":40000' in each.answer for each in steady)
        shed = [each for each in trickling if each.ended_after is not None]
        assert len(shed) >= 30 + 4 - 16, len(shed)
        # A shed upload is told why, before the connection closes.
        assert all(each.answer.startswith("HTTP/1.1 408") for each in shed), [each.answer[:40] for each in shed]
        for each in trickling:
            each.sock.close()


def test_a_body_slower_than_the_minimum_rate_is_closed_long_before_the_body_timeout() -> None:
    settings = ServerConfig(port=0, header_timeout=0.5, body_timeout=30.0, body_min_rate=200.0)
    with running(settings) as port:
        slow = Upload(port, 10_000, 1, 0.1)  # 10 bytes/s
        fast = Upload(port, 40_000, 4_000, 0.1)  # 40 kB/s for 1 s
        slow.wait(5)
        fast.wait(5)
        assert slow.ended_after is not None and slow.ended_after < 3.0
        assert slow.answer.startswith("HTTP/1.1 408") and "server.body_min_rate" in slow.answer
        assert fast.answer.startswith("HTTP/1.1 200") and '"bytes":40000' in fast.answer


# -- the log of a process out of file descriptors ---------------------------------------------------


def accept_failure(message: str = "socket.accept() out of system resource", code: int = errno.EMFILE) -> logging.LogRecord:
    """What asyncio's default exception handler logs for each failed ``accept()``."""
    exc = OSError(code, "Too many open files")
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, (OSError, exc, None))


@pytest.fixture
def said() -> Iterator[list[str]]:
    """The lines ``mlxr_core.http.connections`` logs, however logging is set up."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mlxr_core.http.connections")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_the_accept_failures_of_a_process_out_of_files_are_logged_once_per_interval_with_a_count(
    said: list[str],
) -> None:
    now = [100.0]
    quiet = AcceptErrorLog(interval=10.0, clock=lambda: now[0])
    assert not any(quiet.filter(accept_failure()) for _ in range(3878))  # each held back from asyncio's log
    assert len(said) == 1
    assert "too many open files" in said[0].lower() and "EMFILE" in said[0]
    assert "ulimit -n" in said[0] and "server.max_connections" in said[0] and "Traceback" not in said[0]
    now[0] += 10.5
    assert not quiet.filter(accept_failure(code=errno.ENFILE))
    assert len(said) == 2 and "3877 more in the last 10 s" in said[1]
    # Anything else the event loop logs passes untouched.
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", None, None)
    assert quiet.filter(other) and other.getMessage() == "Task exception was never retrieved"
    reset = accept_failure()
    reset.exc_info = (ConnectionResetError, ConnectionResetError(errno.ECONNRESET, "reset"), None)
    assert quiet.filter(reset) and reset.exc_info is not None


def test_serving_quiets_the_event_loops_accept_failures(said: list[str], caplog: pytest.LogCaptureFixture) -> None:
    serve.uvicorn_config(Litestar([health], logging_config=None), ServerConfig(port=0), log_level="warning")
    asyncio_log = logging.getLogger("asyncio")
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(100):
                asyncio_log.handle(accept_failure())
        assert not [r for r in caplog.records if r.name == "asyncio"]
        assert len(said) == 1
    finally:
        for each in [f for f in asyncio_log.filters if isinstance(f, AcceptErrorLog)]:
            asyncio_log.removeFilter(each)
