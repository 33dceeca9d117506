"""Every error on the Anthropic routes, in Anthropic's shape:
``{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}``.

The error type follows the HTTP status as Anthropic's does (401 ``authentication_error``, 404
``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 503
``overloaded_error``, other 5xx ``api_error``). Mid-stream the same body travels as an
``event: error``, which Anthropic clients raise. Anything unexpected is logged with its traceback
and answered with a bare 500.
"""

from __future__ import annotations

from mlxr_core.errors import MlxrError
from mlxr_core.http.errors import exception_handlers
from mlxr_plugins.apis.anthropic.schemas import ErrorBody, ErrorDetail, encoder

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(exc: MlxrError) -> bytes:
    """The JSON body of ``exc`` (also the data of a stream's ``error`` event)."""
    message = exc.message
    if exc.field and exc.field not in message:
        message = f"{exc.field}: {message}"  # Anthropic names the field the same way
    return encoder.encode(ErrorBody(ErrorDetail(type=error_type(exc.status), message=message)))


#: Exception handlers for the Anthropic router.
EXCEPTION_HANDLERS = exception_handlers(error_body)
