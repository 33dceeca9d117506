"""Every error on the OpenAI routes, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

The handlers are registered on the OpenAI router only, so other APIs keep their own wire formats.
Bad input is a 4xx naming the parameter; anything unexpected is logged here with its traceback and
answered with a bare 500, never with the traceback.
"""

from __future__ import annotations

from mlxr_core.errors import MlxrError
from mlxr_core.http.errors import exception_handlers
from mlxr_core.http.frontend import decode_body
from mlxr_plugins.apis.openai.schemas import ErrorBody, ErrorDetail, encoder

__all__ = ["EXCEPTION_HANDLERS", "decode_body", "error_body"]


def error_body(exc: MlxrError) -> bytes:
    """The JSON body OpenAI clients expect for ``exc`` (also sent as an SSE event mid-stream)."""
    detail = ErrorDetail(message=exc.message, type=exc.kind, param=exc.param, code=exc.code)
    return encoder.encode(ErrorBody(error=detail))


#: Exception handlers for the OpenAI router.
EXCEPTION_HANDLERS = exception_handlers(error_body)
