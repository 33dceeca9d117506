"""The app's OpenAPI document, written from the msgspec structs that decode the requests.

A route takes its body typed (``data: JSONBody[ChatCompletionRequest]``) and returns a struct where
its reply is plain JSON, so Litestar documents both from the annotations. :class:`StructSchemas`, a
Litestar schema plugin on the app, has every msgspec struct written as msgspec's own JSON schema
(:func:`json_schema`): the constraints the decoder enforces (``minLength``, ``minimum``,
``additionalProperties: false``, tags, an ``extra_json_schema``) are the ones published, so a body
the document allows is one the decoder accepts, and the other way round.

What annotations cannot say, :func:`documented` adds as a route's ``operation_class``: the API's
own error body for every 4xx and 5xx (Litestar would document its validation error, which these
routes never send), a 200 that is either JSON or a stream (``text/event-stream``,
``application/x-ndjson``) whose events are described, and the body of a route that reads its raw
body itself:

    @post("/chat/completions", operation_class=documented(
        error=s.ErrorBody, response=s.ChatCompletion,
        stream=Stream("text/event-stream", (s.ChatCompletionChunk, s.ErrorBody), end="data: [DONE]")))

Schemas are inlined (no ``$ref``), which keeps each operation self-contained in the document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from litestar.plugins import OpenAPISchemaPlugin

if TYPE_CHECKING:
    from litestar._openapi.schema_generation import SchemaCreator
    from litestar.typing import FieldDefinition

JSON = "application/json"
FORM = "multipart/form-data"
TEXT = "text/plain"


def json_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema msgspec writes for a type, with every ``$ref`` replaced by its definition
    (keywords next to a ``$ref``, such as an ``extra_json_schema``, kept)."""
    schema = msgspec.json.schema(annotation)
    definitions = schema.pop("$defs", {})

    def inline(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        siblings = {key: inline(value, seen) for key, value in node.items() if key != "$ref"}
        ref = node.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#/$defs/")):
            return siblings
        name = ref.removeprefix("#/$defs/")
        if name in seen:  # a recursive type: leave it open rather than loop
            return siblings
        return {**inline(definitions[name], (*seen, name)), **siblings}

    inlined: dict[str, Any] = inline(schema, ())
    return inlined


@dataclass
class JsonSchema(Schema):
    """A schema given as a JSON schema document, written into the OpenAPI document as it is."""

    document: dict[str, Any] = field(default_factory=dict)

    def to_schema(self) -> dict[str, Any]:
        return self.document


class StructSchemas(OpenAPISchemaPlugin):
    """Litestar schema plugin: a msgspec struct (with the ``Annotated`` metadata it was declared
    with) documented by msgspec's JSON schema, the statement of what its decoder accepts."""

    @staticmethod
    def is_plugin_supported_type(value: Any) -> bool:
        return isinstance(value, type) and issubclass(value, msgspec.Struct)

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: SchemaCreator) -> Schema:
        return JsonSchema(document=json_schema(field_definition.raw))


@dataclass(frozen=True)
class Stream:
    """A streamed 200 reply: its media type and the types an event's JSON may have (the ``data:``
    of a server-sent event, one line of NDJSON)."""

    media_type: str
    events: tuple[Any, ...]
    #: What ends the stream besides its last event (OpenAI's ``data: [DONE]``).
    end: str = ""


@dataclass
class StreamMediaType(OpenAPIMediaType):
    """A streamed media type with the schema of its items under ``x-item-schema`` (what OpenAPI
    3.2 names ``itemSchema``; this document is 3.1)."""

    item_schema: dict[str, Any] | None = field(default=None, metadata={"alias": "x-item-schema"})


def documented(
    *,
    error: Any = None,
    response: Any = None,
    stream: Stream | str | None = None,
    request: Any = None,
    form: Any = None,
    text: bool = False,
    path_strings: tuple[str, ...] = (),
) -> type[Operation]:
    """An ``operation_class`` adding to a route's operation what its annotations cannot say.

    :param error: the msgspec type of the API's error body, documented for every 4xx and 5xx.
    :param response: the msgspec type of a whole 200 reply, for a route that may also stream (a
        route that only answers JSON returns its struct, and Litestar documents it).
    :param stream: the streamed 200 reply, documented next to the JSON one (a media type alone:
        events of any shape).
    :param request: the msgspec type of the body of a route that reads its raw body itself (a
        route with a ``data`` parameter is documented from it).
    :param form: the msgspec type of a ``multipart/form-data`` body a route reads itself, its
        ``file`` field documented as binary (an upload).
    :param text: whether the 200 reply may also be plain text (``text/plain``, a string).
    :param path_strings: path parameters documented as plain non-empty strings (Litestar writes a
        ``{name:path}`` parameter as a URI, which a model name with slashes is not).
    """
    request_schema = None if request is None else json_schema(request)
    form_schema = None if form is None else _form_schema(form)
    response_schema = None if response is None else json_schema(response)
    error_schema = None if error is None else json_schema(error)
    streamed = Stream(stream, (Any,)) if isinstance(stream, str) else stream
    stream_content = None if streamed is None else _stream_content(streamed)

    @dataclass
    class DocumentedOperation(Operation):
        def __post_init__(self) -> None:
            if request_schema is not None:
                schema = JsonSchema(document=request_schema)
                self.request_body = RequestBody(content={JSON: OpenAPIMediaType(schema=schema)}, required=True)
            if form_schema is not None:
                schema = JsonSchema(document=form_schema)
                self.request_body = RequestBody(content={FORM: OpenAPIMediaType(schema=schema)}, required=True)
            responses = dict(self.responses or {})
            if response_schema is not None or stream_content is not None:
                content: dict[str, OpenAPIMediaType] = {}
                if response_schema is not None:
                    content[JSON] = OpenAPIMediaType(schema=JsonSchema(document=response_schema))
                if streamed is not None and stream_content is not None:
                    content[streamed.media_type] = stream_content
                if text:
                    content[TEXT] = OpenAPIMediaType(schema=JsonSchema(document={"type": "string"}))
                responses["200"] = ResponseSpec(description="Request fulfilled", content=content)
            if error_schema is not None:
                # Litestar's own 400 (its validation error shape) never reaches these clients.
                responses = {k: v for k, v in responses.items() if not k.startswith(("4", "5"))}
                for status, description in (("4XX", "Invalid request"), ("5XX", "Server error")):
                    responses[status] = ResponseSpec(
                        description=description,
                        content={JSON: OpenAPIMediaType(schema=JsonSchema(document=error_schema))},
                    )
            self.responses = responses
            for parameter in self.parameters or []:
                if isinstance(parameter, Parameter) and parameter.name in path_strings:
                    parameter.schema = Schema(type=OpenAPIType.STRING, min_length=1)

    return DocumentedOperation


def _form_schema(form: Any) -> dict[str, Any]:
    schema = json_schema(form)
    if "file" in schema.get("properties", {}):
        schema["properties"]["file"] = {"type": "string", "format": "binary", "description": "the uploaded file"}
    return schema


def _stream_content(stream: Stream) -> StreamMediaType:
    if stream.media_type == "text/event-stream":
        shape = "server-sent events, each event's data one JSON object as x-item-schema describes"
    else:
        shape = "one JSON object per line, each as x-item-schema describes"
    ending = f", then {stream.end}" if stream.end else ""
    description = f"The reply streamed (when the request asks for a stream): {shape}{ending}."
    # No type: a validator that reads the stream event by event (an SSE event is an object of
    # its fields) finds each one valid; x-item-schema says what an event's data holds.
    body = {"contentMediaType": stream.media_type, "description": description}
    events = [json_schema(event) for event in stream.events]
    item = events[0] if len(events) == 1 else {"anyOf": events}
    return StreamMediaType(schema=JsonSchema(document=body), item_schema=item)
