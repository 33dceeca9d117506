"""OpenAPI documentation for routes that decode their own bodies.

API plugins read a request's raw body and decode it strictly with msgspec
(:func:`mlxr_core.http.frontend.decode_body`), so Litestar sees no ``data`` parameter and would
document neither the body nor the replies. :func:`documented` returns an ``operation_class`` for a route
decorator that writes the msgspec structs' JSON schemas into the app's OpenAPI document, so clients
and property-based fuzzers see the real contract:

    @post("/chat/completions", operation_class=documented(
        request=s.ChatCompletionRequest, response=s.ChatCompletion, error=s.ErrorBody,
        stream="text/event-stream"))

Schemas are inlined (no ``$ref``), which keeps each operation self-contained in the document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    Parameter,
    RequestBody,
    Schema,
)
from litestar.openapi.spec import OpenAPIResponse as ResponseSpec

JSON = "application/json"


def json_schema(struct: Any) -> dict[str, Any]:
    """The JSON schema of a msgspec type with every ``$ref`` replaced by its definition."""
    schema = msgspec.json.schema(struct)
    definitions = schema.pop("$defs", {})

    def inline(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:  # a recursive type: leave it open rather than loop
                return {}
            return inline(definitions[name], (*seen, name))
        return {key: inline(value, seen) for key, value in node.items()}

    inlined: dict[str, Any] = inline(schema, ())
    return inlined


def documented(
    *,
    request: Any = None,
    response: Any = None,
    error: Any = None,
    stream: str | None = None,
    path_strings: tuple[str, ...] = (),
) -> type[Operation]:
    """An ``operation_class`` documenting a route's JSON body, its 200 reply and its error replies.

    :param request: the msgspec type the route decodes its body into (None: no body).
    :param response: the msgspec type of a whole (non-streaming) 200 reply.
    :param error: the msgspec type of the API's error body, documented for every 4xx and 5xx.
    :param stream: the media type of a streamed 200 reply (``text/event-stream``,
        ``application/x-ndjson``), documented next to the JSON one.
    :param path_strings: path parameters documented as plain non-empty strings (Litestar writes a
        ``{name:path}`` parameter as a URI, which a model name with slashes is not).
    """
    request_schema = None if request is None else json_schema(request)
    response_schema = None if response is None else json_schema(response)
    error_schema = None if error is None else json_schema(error)

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            if request_schema is not None:
                self.request_body = RequestBody(
                    content={JSON: OpenAPIMediaType(schema=request_schema)},  # type: ignore[arg-type]
                    required=True,
                )
            responses = dict(self.responses or {})
            if response_schema is not None:
                content = {JSON: OpenAPIMediaType(schema=response_schema)}  # type: ignore[arg-type]
                if stream is not None:
                    content[stream] = OpenAPIMediaType(schema={"type": "string"})  # type: ignore[arg-type]
                responses["200"] = ResponseSpec(description="Request fulfilled", content=content)
            if error_schema is not None:
                # Litestar's own 400 (its validation error shape) never reaches these clients.
                responses = {k: v for k, v in responses.items() if not k.startswith(("4", "5"))}
                for status, description in (("4XX", "Invalid request"), ("5XX", "Server error")):
                    responses[status] = ResponseSpec(
                        description=description,
                        content={JSON: OpenAPIMediaType(schema=error_schema)},  # type: ignore[arg-type]
                    )
            self.responses = responses
            for parameter in self.parameters or []:
                if isinstance(parameter, Parameter) and parameter.name in path_strings:
                    parameter.schema = Schema(type=OpenAPIType.STRING, min_length=1)

    return DocumentedOperation
