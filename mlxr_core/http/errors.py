"""Exception handlers an API plugin mounts on its router, built around its own error body.

Every API answers errors in its own wire format but treats them alike: an :class:`MlxrError` keeps
its status (with ``Retry-After`` where waiting helps), a Litestar HTTP error (413, 405 ...) becomes
an ``MlxrError`` of that status, and anything unexpected is logged with its traceback and answered
with a bare 500, never the traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from mlxr_core.errors import EngineStopped, MlxrError, Overloaded

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

    def on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
        log.error("%s %s raised", request.method, request.url.path, exc_info=exc)
        return error_response(MlxrError("internal server error"), body)

    return {MlxrError: on_mlxr_error, HTTPException: on_http_error, Exception: on_unexpected}
