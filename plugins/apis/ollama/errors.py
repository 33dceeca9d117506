"""Every error on the Ollama routes, in Ollama's shape: ``{"error": "message"}`` with a 4xx/5xx.

Ollama clients raise ``ResponseError(error, status_code)`` from it; mid-stream the same object is
sent as the last NDJSON line. Anything unexpected is logged with its traceback and answered with a
bare 500.
"""

from __future__ import annotations

from mlxr_core.errors import MlxrError
from mlxr_core.http.errors import exception_handlers
from mlxr_plugins.apis.ollama.schemas import ErrorBody, encoder


def error_message(exc: MlxrError) -> str:
    """The message, prefixed by the parameter it names when it does not say it already."""
    if exc.field and exc.field not in exc.message:
        return f"{exc.field}: {exc.message}"
    return exc.message


def error_body(exc: MlxrError) -> bytes:
    """The JSON body of ``exc``: ``{"error": "..."}``."""
    return encoder.encode(ErrorBody(error_message(exc)))


def error_line(exc: MlxrError) -> bytes:
    """The NDJSON line that ends a stream with ``exc``."""
    return error_body(exc) + b"\n"


#: Exception handlers for the Ollama router.
EXCEPTION_HANDLERS = exception_handlers(error_body)
