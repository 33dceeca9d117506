"""Every error on the Anthropic routes, in Anthropic's shape:
``{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}``.

The error type follows the HTTP status as Anthropic's does (401 ``authentication_error``, 404
``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 503
``overloaded_error``, other 5xx ``api_error``). Mid-stream the same body travels as an
``event: error``, which Anthropic clients raise. Anything unexpected is logged with its traceback
and answered with a bare 500.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from mlxr_core.errors import EngineStopped, MlxrError, Overloaded
from mlxr_plugins.apis.anthropic.schemas import ErrorBody, ErrorDetail, encoder

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
#: ``Retry-After`` seconds for 429 (queue full) and 503 (loading or stopping).
RETRY_AFTER_S = {Overloaded: 1, EngineStopped: 5}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(exc: MlxrError) -> bytes:
    """The JSON body of ``exc`` (also the data of a stream's ``error`` event)."""
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"  # Anthropic names the field the same way
    return encoder.encode(ErrorBody(ErrorDetail(type=error_type(exc.status), message=message)))


def error_response(exc: MlxrError) -> Response[bytes]:
    headers = {}
    for kind, seconds in RETRY_AFTER_S.items():
        if isinstance(exc, kind):
            headers["Retry-After"] = str(seconds)
    return Response(error_body(exc), status_code=exc.status, media_type="application/json", headers=headers)


def _on_mlxr_error(request: Request[Any, Any, Any], exc: MlxrError) -> Response[bytes]:
    if exc.status >= 500 and not isinstance(exc, (EngineStopped, Overloaded)):
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return error_response(exc)


def _on_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    error = MlxrError(str(exc.detail))
    error.status = exc.status_code
    return error_response(error)


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.error("%s %s raised", request.method, request.url.path, exc_info=exc)
    return error_response(MlxrError("internal server error"))


#: Exception handlers for the Anthropic router.
EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    MlxrError: _on_mlxr_error,
    HTTPException: _on_http_error,
    Exception: _on_unexpected,
}
