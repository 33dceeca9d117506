"""Every error on the OpenAI routes, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

The handlers are registered on the OpenAI router only, so other APIs keep their own wire formats.
Bad input is a 4xx naming the parameter; anything unexpected is logged here with its traceback and
answered with a bare 500, never with the traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from mlxr_core.errors import EngineStopped, MlxrError, Overloaded
from mlxr_core.frontend import decode_body
from mlxr_plugins.apis.openai.schemas import ErrorBody, ErrorDetail, encoder

__all__ = ["EXCEPTION_HANDLERS", "decode_body", "error_body", "error_response"]

log = logging.getLogger(__name__)

#: ``Retry-After`` seconds for 429 (queue full) and 503 (loading or stopping).
RETRY_AFTER_S = {Overloaded: 1, EngineStopped: 5}


def error_body(exc: MlxrError) -> bytes:
    """The JSON body OpenAI clients expect for ``exc`` (also sent as an SSE event mid-stream)."""
    detail = ErrorDetail(message=exc.message, type=exc.kind, param=exc.param, code=exc.code)
    return encoder.encode(ErrorBody(error=detail))


def error_response(exc: MlxrError) -> Response[bytes]:
    """The HTTP response for ``exc``, with ``Retry-After`` where waiting helps."""
    headers = {}
    for kind, seconds in RETRY_AFTER_S.items():
        if isinstance(exc, kind):
            headers["Retry-After"] = str(seconds)
    return Response(
        error_body(exc), status_code=exc.status, media_type="application/json", headers=headers
    )


def _on_mlxr_error(request: Request[Any, Any, Any], exc: MlxrError) -> Response[bytes]:
    if exc.status >= 500 and not isinstance(exc, (EngineStopped, Overloaded)):
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
    return error_response(exc)


def _on_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    error = MlxrError(str(exc.detail))
    error.status = status
    error.kind = "invalid_request_error" if status < 500 else "server_error"
    return error_response(error)


def _on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.error("%s %s raised", request.method, request.url.path, exc_info=exc)
    return error_response(MlxrError("internal server error"))


#: Exception handlers for the OpenAI router.
EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    MlxrError: _on_mlxr_error,
    HTTPException: _on_http_error,
    Exception: _on_unexpected,
}
