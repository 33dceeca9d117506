"""Exception handlers an API plugin mounts on its router, built around its own error body.

Every API answers errors in its own wire format but treats them alike: an :class:`MlxrError` keeps
its status (with ``Retry-After`` where waiting helps), Litestar's own validation error (a body or
parameter its handler's types refuse) becomes a :class:`RequestError` naming the field, its other
HTTP errors (413, 405 ...) an ``MlxrError`` of that status, and anything unexpected is logged with
its traceback and answered with a bare 500, never the traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap

from mlxr_core.errors import EngineStopped, MlxrError, Overloaded, RequestError

log = logging.getLogger(__name__)

#: ``Retry-After`` seconds for 429 (queue full) and 503 (loading or stopping).
RETRY_AFTER_S = {Overloaded: 1, EngineStopped: 5}

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
        if exc.status >= 500 and not isinstance(exc, (EngineStopped, Overloaded)):
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
