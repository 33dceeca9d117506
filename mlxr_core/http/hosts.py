"""Which ``Host`` headers the server answers: a guard against DNS rebinding.

A page on ``http://evil.example:8000`` whose name the attacker then points at 127.0.0.1 can send
same-origin requests to a server on the visitor's loopback and read the answers: the browser
believes it talks to ``evil.example``, and the request says so in its ``Host`` header. A server
bound to a loopback address therefore answers only a ``Host`` that names it: ``localhost``, a
loopback address, the address it is bound to, or a name listed in ``server.allowed_hosts``, with
or without a port. Anything else gets a 403 before any route runs.

A server bound to another address (``0.0.0.0``, a LAN address) is reached under names the operator
chose, so it answers every ``Host`` unless ``server.allowed_hosts`` is set; then the same rule
applies, any address of the machine counting as a name of it when bound to all of them. An address
in ``Host`` is never a DNS rebinding (no name to rebind), so ``*`` in ``allowed_hosts`` answers all.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from litestar.types import (
    ASGIApp,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    Receive,
    Scope,
    Send,
)

if TYPE_CHECKING:
    from mlxr_core.config.schema import ServerConfig

log = logging.getLogger(__name__)

#: Seconds between two log lines about refused ``Host`` headers.
LOG_INTERVAL_S = 60.0


def host_name(header: str) -> str:
    """The name or address a ``Host`` header names: lowercase, without its port, brackets or
    trailing dot (``"[::1]:8000"`` -> ``"::1"``, ``"LocalHost.:80"`` -> ``"localhost"``)."""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.partition("%")[0])  # a zone (fe80::1%eth0) names no other host
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    address = _address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return host == "localhost" or (address is not None and address.is_loopback)


class AllowedHosts:
    """The ``Host`` names a server bound to ``bind`` answers (:func:`allowed_hosts` for a config)."""

    def __init__(self, bind: str, names: Iterable[str] = ()):
        self.bind = host_name(bind)
        self.names = frozenset(host_name(name) for name in names)
        bound = _address(self.bind)
        #: Bound to every address of the machine: any address in ``Host`` is one of its own.
        self.any_address = bound is not None and bound.is_unspecified
        #: Whether ``Host`` is checked at all.
        self.enabled = "*" not in self.names and (bool(self.names) or _is_loopback(self.bind))

    def allows(self, header: str | None) -> bool:
        """Whether a request with this ``Host`` header is answered. A request without one (HTTP/1.0)
        comes from no browser, so from no rebinding: answered."""
        if not self.enabled or not header:
            return True
        host = host_name(header)
        if host in self.names or host == self.bind or _is_loopback(host):
            return True
        if self.any_address and _address(host) is not None:
            return True
        # *.localhost resolves to loopback by definition (RFC 6761); no public name can claim it.
        if host.endswith(".localhost"):
            return True
        return any(name.startswith(".") and (host.endswith(name) or host == name[1:]) for name in self.names)


def allowed_hosts(server: ServerConfig) -> AllowedHosts:
    """The ``Host`` names the server of this config answers."""
    return AllowedHosts(server.host, server.allowed_hosts)


class HostCheck:
    """ASGI middleware answering 403 to a request whose ``Host`` the server does not answer
    (:class:`AllowedHosts`), before the app sees it; a WebSocket is closed (1008)."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts):
        self.app = app
        self.allowed = allowed
        self._logged_at: float | None = None
        self._refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.allowed.enabled:
            await self.app(scope, receive, send)
            return
        headers = [value for name, value in scope.get("headers", []) if name == b"host"]
        header = headers[0].decode("latin-1") if headers else None
        if len(headers) <= 1 and self.allowed.allows(header):
            await self.app(scope, receive, send)
            return
        self._log(header or "")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Host not allowed"})
            return
        shown = (header or "")[:100]
        body = json.dumps({
            "error": f"this server does not answer for Host {shown!r}: it answers localhost, its own "
            "addresses and the names in its server.allowed_hosts setting (a guard against DNS "
            "rebinding); reach it by one of those, or add the name to server.allowed_hosts"
        }).encode()
        start: HTTPResponseStartEvent = {
            "type": "http.response.start",
            "status": 403,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
        await send(start)
        end: HTTPResponseBodyEvent = {"type": "http.response.body", "body": body, "more_body": False}
        await send(end)

    def _log(self, header: str) -> None:
        """Say it once per :data:`LOG_INTERVAL_S` with a count: a page may send many."""
        now = time.monotonic()
        self._refused += 1
        if self._logged_at is not None and now - self._logged_at < LOG_INTERVAL_S:
            return
        log.warning(
            "refused %d request(s) for a Host this server does not answer, the last %r (a web page "
            "rebinding a name to this machine, or a name missing from server.allowed_hosts)",
            self._refused, header[:100],
        )
        self._logged_at, self._refused = now, 0
