"""The operator's side of every request: API keys, request ids, the access log and HTTP metrics.

- :func:`api_key_guard` is a Litestar guard on every route. It raises :class:`Unauthorized`, a
  :class:`~mlxr_core.errors.MlxrError`, so each API plugin's own exception handlers answer the 401
  in that API's wire format (OpenAI, Ollama and Anthropic clients each read their own). It notes
  which key a request came with as an owner id (:func:`key_owner`: a hash, never the key), for
  data a key keeps on the server, such as stored responses, that other keys must not reach.
- :class:`AdminAccess` guards what changes the models served (loading and unloading): admin
  keys (``server.admin_api_keys``) where set, loopback callers otherwise.
- :func:`json_body_guard`, likewise on every route, answers 415 to a POST, PUT or PATCH whose
  ``Content-Type`` is not JSON: a web page can send ``text/plain`` or a form across sites without
  asking (no CORS preflight), never ``application/json``.
- :class:`RequestLog` is the outermost ASGI layer: unmatched routes (404/405) pass through it too.
  It gives each request an id (the client's ``x-request-id`` when it is a plain token, else a new
  one), returns it in the ``x-request-id`` header, counts the request by route template and status,
  and writes one line per request to the ``mlxr.access`` logger when the response ends.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from mlxr_core.config.schema import is_loopback
from mlxr_core.engine.request import ARRIVING
from mlxr_core.errors import MlxrError
from mlxr_core.http.context import KEY_OWNER, REQUEST_ID, REQUEST_STATE

if TYPE_CHECKING:
    from mlxr_core.config.schema import ServerConfig
    from mlxr_core.engine.request import Arrivals
    from mlxr_core.http.metrics import Metrics

access_log = logging.getLogger("mlxr.access")

#: A client-supplied request id is reused only when it cannot inject anything into a log line.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The route label of requests no route matched (bounded cardinality: never the raw path).
UNMATCHED = "unmatched"


class Unauthorized(MlxrError):
    """A request without a valid API key."""

    status = 401


class ApiKeys:
    """The configured keys, compared in constant time.

    Keys are hashed first so :func:`hmac.compare_digest` compares equal-length digests (its time
    then depends on neither the key's content nor its length), and every key is compared so the
    time does not reveal which one matched.
    """

    def __init__(self, keys: Iterable[str], exempt: Iterable[str] = ()):
        present = [key for key in keys if key]
        self._digests = [_digest(key) for key in present]
        self._owners = [owner_id(key) for key in present]
        self.exempt = frozenset(exempt)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def matches(self, presented: str) -> bool:
        return self.owner(presented) is not None

    def owner(self, presented: str) -> str | None:
        """The :func:`owner_id` of the configured key ``presented`` is, or None."""
        digest = _digest(presented)
        found = None
        for known, owner in zip(self._digests, self._owners, strict=True):
            if hmac.compare_digest(digest, known):
                found = owner
        return found

    def check(self, path: str, headers: Any) -> str | None:
        """Raise :class:`Unauthorized` unless ``path`` is exempt or ``headers`` carry a valid key
        (``Authorization: Bearer KEY`` or ``x-api-key: KEY``); the key's :func:`owner_id`, or
        None where no key is needed."""
        if not self._digests or path in self.exempt:
            return None
        candidates = []
        authorization = headers.get("authorization")
        if authorization:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                candidates.append(token.strip())
        api_key = headers.get("x-api-key")
        if api_key:
            candidates.append(api_key.strip())
        if not candidates:
            raise Unauthorized(
                "missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            )
        owner = next((owner for owner in map(self.owner, candidates) if owner is not None), None)
        if owner is None:
            raise Unauthorized("invalid API key")
        return owner


class UnsupportedMediaType(MlxrError):
    """A request body that is not declared as JSON, to a route that reads JSON."""

    status = 415


#: Methods whose body a route reads.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type (``application/problem+json``), any parameters."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


#: Headers every current browser adds to a POST (``Origin``) or to any request (``Sec-Fetch-*``).
BROWSER_HEADERS = ("origin", "sec-fetch-site", "sec-fetch-mode")


def json_body_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Refuse a browser's body not declared as JSON (:class:`UnsupportedMediaType`, 415): a web page
    can POST a form or text/plain to another site without a CORS preflight, never JSON, so a
    page a user visits cannot drive a server on their machine. A request without a browser's
    headers (``curl -d '{...}'``, as Ollama's own examples send, declaring a form) is read as the
    JSON it is. A route that reads another media type lists it in its ``opt["content_types"]``."""
    if connection.scope.get("method") not in BODY_METHODS:
        return
    content_type = connection.headers.get("content-type", "")
    accepted = handler.opt.get("content_types", ())
    if is_json(content_type) or content_type.partition(";")[0].strip().lower() in accepted:
        return
    if not any(name in connection.headers for name in BROWSER_HEADERS):
        return
    raise UnsupportedMediaType(
        f"the request body must be JSON (Content-Type: application/json), not "
        f"{content_type or 'undeclared'}"
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def owner_id(key: str) -> str:
    """The id under which data made with API key ``key`` is kept: a hash of the key, slowed (once
    per key, at start) so a copied data file does not cheaply confirm guesses of a weak key."""
    digest = hashlib.pbkdf2_hmac("sha256", key.encode("utf-8", "surrogatepass"), b"mlxr key owner", 20_000)
    return digest.hex()




def key_owner(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The :func:`owner_id` of the API key ``connection`` came with, or None where the server
    has no keys (or the route needs none): data kept for it belongs to that key alone."""
    owner: str | None = connection.scope.get("state", {}).get(KEY_OWNER)
    return owner


#: A GET route handler with ``opt={PUBLIC: True}`` is served without a key: only for files that hold
#: no data and are the same for everyone, such as the web page's own HTML (a browser cannot add a
#: header to a page it navigates to); the requests that page makes for data still need the key.
PUBLIC = "public"


def api_key_guard(keys: ApiKeys) -> Any:
    """A Litestar guard enforcing ``keys`` on every route it is attached to but :data:`PUBLIC` ones."""

    def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        if handler.opt.get(PUBLIC) is True and connection.scope.get("method") in ("GET", "HEAD"):
            return
        owner = keys.check(connection.scope["path"], connection.headers)
        if owner is not None:
            connection.scope.setdefault("state", {})[KEY_OWNER] = owner

    return guard


class Forbidden(MlxrError):
    """A valid request its caller may not make (an API key that may not administer the server)."""

    status = 403


class AdminAccess:
    """Who may change what the server serves: load and unload models and LoRA adapters.

    With ``server.admin_api_keys`` set, only a request carrying one of them (401 without a valid
    key, 403 with a key of ``api_keys`` alone); admin keys pass the app's key guard as well, so
    one key does both. Without admin keys, a loopback server keeps its every caller's rights (any
    valid key, or anyone where it has none), and a server reachable from other machines refuses
    (403): its client keys are handed out, and anyone who can reach it could otherwise evict the
    models everyone uses. A Litestar guard (``guards=[access]``), or :meth:`check` for a request
    whose body decides (Ollama's ``keep_alive: 0``).
    """

    def __init__(self, admin_keys: Iterable[str], *, loopback: bool):
        self.keys = ApiKeys(admin_keys)
        self.loopback = loopback

    def check(self, connection: ASGIConnection[Any, Any, Any, Any], action: str = "loading and unloading models") -> None:
        """Raise :class:`Unauthorized` or :class:`Forbidden` unless ``connection`` may administer."""
        if self.keys.enabled:
            try:
                self.keys.check("", connection.headers)
            except Unauthorized:
                if key_owner(connection) is None:  # no valid client key either
                    raise
                raise Forbidden(f"{action} needs an admin key (server.admin_api_keys); this API key may not") from None
            return
        if not self.loopback:
            raise Forbidden(
                f"{action} needs an admin key on a server reachable from other machines: set server.admin_api_keys "
                "(or MLXR_ADMIN_API_KEY)"
            )

    def __call__(self, connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        self.check(connection)


@functools.lru_cache(maxsize=8)
def _admin_access(keys: tuple[str, ...], loopback: bool) -> AdminAccess:
    return AdminAccess(keys, loopback=loopback)


def admin_access(server: ServerConfig) -> AdminAccess:
    """The :class:`AdminAccess` of ``server``'s config (made once: hashing a key is slowed)."""
    return _admin_access(tuple(server.admin_api_keys), is_loopback(server.host))


class RequestLog:
    """Outermost ASGI middleware: request id, HTTP metrics and one access-log line per request."""

    def __init__(
        self, app: ASGIApp, metrics: Metrics, *, log_requests: bool = True, arrivals: Arrivals | None = None
    ):
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests
        #: The engine's count of requests received and not yet submitted: each POST is counted in
        #: here, and out when it is submitted, answered or ends.
        self.arrivals = arrivals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _client_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())
        status = 500  # what the client gets if the app fails before it starts a response
        sent = 0
        started = time.perf_counter()

        arrival = self.arrivals.arrive() if self.arrivals is not None and scope.get("method") == "POST" else None
        arriving = ARRIVING.set(arrival)
        naming = REQUEST_ID.set(request_id)
        stating = REQUEST_STATE.set(scope["state"])  # type: ignore[typeddict-item]

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                if arrival is not None:
                    arrival.leave()
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}  # type: ignore[typeddict-item]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        method = str(scope.get("method", "-"))
        path = scope.get("raw_path", b"").decode("latin-1") or scope["path"]
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if arrival is not None:
                arrival.leave()
            ARRIVING.reset(arriving)
            REQUEST_ID.reset(naming)
            REQUEST_STATE.reset(stating)
            seconds = time.perf_counter() - started
            # Litestar writes the matched route's template into the scope while routing.
            endpoint = scope.get("path_template") or UNMATCHED  # type: ignore[typeddict-item]
            self.metrics.observe_http(method, endpoint, status, seconds)
            if self.log_requests:
                client = scope.get("client")
                access_log.info(
                    "%s %s %s %s %d %.1fms %dB",
                    request_id, client[0] if client else "-", method, path, status, seconds * 1000, sent,
                )


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.fullmatch(text) else None
    return None
