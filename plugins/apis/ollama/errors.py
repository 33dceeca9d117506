"""Every error on the Ollama routes, in Ollama's shape: ``{"error": "message"}`` with a 4xx/5xx.

Ollama clients raise ``ResponseError(error, status_code)`` from it; mid-stream the same object is
sent as the last NDJSON line. Anything unexpected is logged with its traceback and answered with a
bare 500.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from mlxr_core.errors import EngineStopped, MlxrError, Overloaded
from mlxr_plugins.apis.ollama.schemas import ErrorBody, encoder

log = logging.getLogger(__name__)

#: ``Retry-After`` seconds for 429 (queue full) and 503 (loading or stopping).
RETRY_AFTER_S = {Overloaded: 1, EngineStopped: 5}


def error_message(exc: MlxrError) -> str:
    """The message, prefixed by the parameter it names when it does not say it already."""
    if exc.param and exc.param not in exc.message:
        return f"{exc.param}: {exc.message}"
    return exc.message


def error_line(exc: MlxrError) -> bytes:
    """The NDJSON line that ends a stream with ``exc``."""
    return encoder.encode(ErrorBody(error_message(exc))) + b"\n"


def error_response(exc: MlxrError) -> Response[bytes]:
    headers = {}
    for kind, seconds in RETRY_AFTER_S.items():
        if isinstance(exc, kind):
            headers["Retry-After"] = str(seconds)
    body = encoder.encode(ErrorBody(error_message(exc)))
    return Response(body, status_code=exc.status, media_type="application/json", headers=headers)


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


#: Exception handlers for the Ollama router.
EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    MlxrError: _on_mlxr_error,
    HTTPException: _on_http_error,
    Exception: _on_unexpected,
}
