"""Exception handlers an API plugin mounts on its router, built around its own error body.

Every API answers errors in its own wire format but treats them alike: an :class:`MlxrError` keeps
its status (with ``Retry-After`` where waiting helps), Litestar's own validation error (a body or
parameter its handler's types refuse) becomes a :class:`RequestError` naming the field, its other
HTTP errors (413, 405 ...) an ``MlxrError`` of that status, and anything unexpected is logged with
its traceback and answered with a bare 500, never the traceback.

A request no route matches never reaches a router's handlers: :func:`unmatched_route_handlers`, on
the app, answers its 404 (or the 405 of a path that serves other methods) in the error shape of the
API whose routes the path falls under; :func:`allow_every_method` makes an ``OPTIONS`` answer list
every method of its path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from litestar import Request, Response, Router
from litestar.datastructures import MutableScopeHeaders
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)
from litestar.types import ExceptionHandler, ExceptionHandlersMap, Message, Scope

from mlxr_core.errors import EngineStopped, MlxrError, ModelUnavailable, Overloaded, RequestError

log = logging.getLogger(__name__)

#: ``Retry-After`` seconds for 429 (queue full) and 503 (loading, stopping, a model unavailable).
RETRY_AFTER_S = {Overloaded: 1, EngineStopped: 5, ModelUnavailable: 5}

ErrorBody = Callable[[MlxrError], bytes]


def error_response(exc: MlxrError, body: ErrorBody) -> Response[bytes]:
    """The HTTP response for ``exc`` with ``body(exc)`` and ``Retry-After`` where waiting helps."""
    headers = {}
    for kind, seconds in RETRY_AFTER_S.items():
        if isinstance(exc, kind):
            headers["Retry-After"] = str(seconds)
    return Response(
        body(exc), status_code=exc.status, media_type="application/json", headers=headers
    )


def exception_handlers(body: ErrorBody) -> ExceptionHandlersMap:
    """Handlers for a router whose API writes errors with ``body``."""

    def on_mlxr_error(request: Request[Any, Any, Any], exc: MlxrError) -> Response[bytes]:
        if exc.status >= 500 and not isinstance(exc, (EngineStopped, Overloaded, ModelUnavailable)):
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(exc, body)

    def on_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
        error = MlxrError(str(exc.detail))
        error.status = exc.status_code
        return error_response(error, body)

    def on_invalid(request: Request[Any, Any, Any], exc: ValidationException) -> Response[bytes]:
        return error_response(validation_error(exc), body)

    def on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        log.error("%s %s raised", request.method, request.url.path, exc_info=exc)
        return error_response(MlxrError("internal server error"), body)

    return {
        MlxrError: on_mlxr_error,
        ValidationException: on_invalid,
        HTTPException: on_http_error,
        Exception: on_unexpected,
    }


def validation_error(exc: ValidationException) -> RequestError:
    """Litestar's validation error as a :class:`RequestError` naming the field of its first
    problem (``{"message": ..., "key": "messages", "source": "body"}``); ``data`` is the body."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    first = problems[0] if problems and isinstance(problems[0], dict) else {}
    key, message = first.get("key"), first.get("message")
    if key == "data":  # no body at all: Litestar's "missing required field `data`"
        return RequestError("the request body is empty; send a JSON object")
    if not message:
        return RequestError(str(exc.detail))
    source = getattr(first.get("source"), "value", first.get("source"))  # ParamType.QUERY -> "query"
    where = f" ({source} parameter)" if source not in (None, "body") else ""
    return RequestError(f"invalid request: {message}{where}", field=key if isinstance(key, str) else None)


class RouteNotFound(MlxrError):
    """No route serves the path."""

    status = 404


class MethodNotAllowed(MlxrError):
    """The path is served, not with this method."""

    status = 405


def unmatched_route_handlers(routers: Sequence[Router], fallback: ExceptionHandler) -> ExceptionHandlersMap:
    """App-level handlers for a request no route matched (404) or whose path serves other methods
    (405), answered by the router whose routes share the most leading path segments with it (one at
    least: ``/v1/messages/x`` goes to the router of ``/v1/messages``, ``/v1/x`` to the first of
    ``routers`` under ``/v1``), in that router's error shape; ``fallback`` answers the rest."""
    prefixes = [(router, [_segments(route.path) for route in router.routes]) for router in routers]

    def owner(path: str) -> Router | None:
        segments = _segments(path)
        best, best_shared = None, 0
        for router, paths in prefixes:
            shared = max((_shared(segments, route) for route in paths), default=0)
            if shared > best_shared:  # ties go to the router listed first
                best, best_shared = router, shared
        return best

    def answer(request: Request[Any, Any, Any], exc: HTTPException, error: MlxrError) -> Response[Any]:
        if "route_handler" in request.scope:  # a matched route raised it: what its layers say
            merged = request.route_handler.resolve_exception_handlers()
            mine = {NotFoundException, MethodNotAllowedException}
            handler = _handler_for({k: v for k, v in merged.items() if k not in mine}, exc)
            error.message = str(exc.detail)
            return handler(request, exc) if handler is not None else fallback(request, error)
        router = owner(request.url.path)
        handler = None if router is None else _handler_for(router.exception_handlers, error)
        response: Response[Any] = (handler or fallback)(request, error)
        for name, value in (exc.headers or {}).items():  # a 405's Allow
            response.headers.setdefault(name, value)
        return response

    def on_not_found(request: Request[Any, Any, Any], exc: NotFoundException) -> Response[Any]:
        return answer(request, exc, RouteNotFound(f"no route {request.method} {request.url.path}"))

    def on_method_not_allowed(request: Request[Any, Any, Any], exc: MethodNotAllowedException) -> Response[Any]:
        allowed = (exc.headers or {}).get("allow", "")
        message = f"{request.url.path} does not answer {request.method}" + (f"; it answers {allowed}" if allowed else "")
        return answer(request, exc, MethodNotAllowed(message))

    return {NotFoundException: on_not_found, MethodNotAllowedException: on_method_not_allowed}


async def allow_every_method(message: Message, scope: Scope) -> None:
    """A ``before_send`` hook: the ``Allow`` of Litestar's answer to ``OPTIONS`` lists every method
    the path answers. Litestar writes the methods of the handlers registered with the first one for
    the path, so a path whose handlers come from two places (``/v1/models/{id}``: GET from the model
    list, POST from model admin) answered ``Allow: GET, OPTIONS``."""
    if message["type"] != "http.response.start" or scope.get("method") != "OPTIONS":
        return
    handler = scope.get("route_handler")
    methods: set[str] = set()
    for path in getattr(handler, "paths", ()):
        methods.update(scope["litestar_app"].route_handler_method_map.get(path, {}))
    if methods:
        headers = MutableScopeHeaders.from_message(message)
        if "allow" in headers:
            headers["allow"] = ", ".join(sorted(methods))


def _segments(path: str) -> list[str]:
    return [segment for segment in path.split("/") if segment]


def _shared(path: list[str], route: list[str]) -> int:
    """How many leading segments two paths share."""
    differ = (i for i, (ours, theirs) in enumerate(zip(path, route, strict=False)) if ours != theirs)
    return next(differ, min(len(path), len(route)))


def _handler_for(handlers: ExceptionHandlersMap, exc: Exception) -> ExceptionHandler | None:
    """The handler Litestar would pick for ``exc`` from ``handlers``: by status, then by class."""
    status = getattr(exc, "status_code", getattr(exc, "status", None))
    if isinstance(status, int) and status in handlers:
        return handlers[status]
    return next((handlers[kind] for kind in type(exc).__mro__ if kind in handlers), None)
