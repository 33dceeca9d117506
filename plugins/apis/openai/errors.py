"""Every error on the OpenAI routes, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

``type`` follows the HTTP status as OpenAI's does (``invalid_request_error`` for 4xx,
``rate_limit_error`` for 429, ``server_error`` for 5xx), ``param`` is the field the error names and
``code`` the reason where OpenAI clients look for one (``model_not_found``,
``context_length_exceeded``, ``invalid_api_key`` ...). The handlers are registered on the OpenAI
router only, so other APIs keep their own wire formats. Anything unexpected is logged with its
traceback and answered with a bare 500, never with the traceback.
"""

from __future__ import annotations

from mlxr_core.errors import ContextLengthExceeded, KvBudgetExceeded, MlxrError, ModelNotFound
from mlxr_core.http.access import Unauthorized, UnsupportedMediaType
from mlxr_core.http.errors import exception_handlers
from mlxr_plugins.apis.openai.schemas import ErrorBody, ErrorDetail, encoder

#: ``error.code`` by error class (the first class in an error's MRO listed here).
CODES: dict[type[MlxrError], str] = {
    ModelNotFound: "model_not_found",
    ContextLengthExceeded: "context_length_exceeded",
    KvBudgetExceeded: "kv_budget_exceeded",
    Unauthorized: "invalid_api_key",
    UnsupportedMediaType: "unsupported_media_type",
}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_code(exc: MlxrError) -> str | None:
    """OpenAI's ``error.code`` for ``exc``, None where OpenAI gives none."""
    return next((CODES[kind] for kind in type(exc).__mro__ if kind in CODES), None)


def error_body(exc: MlxrError) -> bytes:
    """The JSON body OpenAI clients expect for ``exc`` (also sent as an SSE event mid-stream)."""
    detail = ErrorDetail(message=exc.message, type=error_type(exc.status), param=exc.field, code=error_code(exc))
    return encoder.encode(ErrorBody(error=detail))


#: Exception handlers for the OpenAI router.
EXCEPTION_HANDLERS = exception_handlers(error_body)
