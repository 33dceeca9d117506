"""The grammar fields clients send, and the one constraint of a request.

Clients written for other servers constrain the output with those servers' fields: vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, llama.cpp's
``grammar`` (GBNF) and top-level ``json_schema``. An API's request struct extends
:class:`GrammarFields`, so they decode strictly and its OpenAPI document lists them;
:func:`request_constraint` turns them, with the API's own field (OpenAI's ``response_format``),
into the request's :class:`~mlxr_core.engine.request.Constraint`. A request holds one: two are
refused, naming both. Each constraint carries the field it came from, so a grammar the sampler
plugin cannot compile (checked when the request is submitted, before it is queued) is a 400
naming that field.

A ``grammar`` is GBNF, or Lark when it reads as Lark (a ``start`` rule, or ``%llguidance``) as
llama.cpp and vLLM's llguidance backend take it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from mlxr_core.chat.tools import constraints_supported
from mlxr_core.engine.request import Constraint
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import MAX_BODY_DEPTH, body_depth

#: A JSON Schema: the object, or (as vLLM takes it) its JSON text.
Schema = dict[str, Any] | str
#: The strings the whole output must be one of.
Choices = Annotated[list[str], Meta(min_length=1)]


class StructuredOutputs(Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``structured_outputs``: one of a JSON schema, a regular expression, a list of choices,
    a grammar (GBNF or Lark) or any JSON object."""

    json: Schema | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GrammarFields(Struct, kw_only=True):
    """The grammar fields of a request; an API's request struct extends it."""

    #: vLLM's structured output.
    structured_outputs: StructuredOutputs | None = None
    #: vLLM's former names of ``structured_outputs``' fields.
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    #: llama.cpp's: a GBNF grammar (or a Lark one) and a JSON schema.
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


def request_constraint(
    ctx: ServerContext, fields: GrammarFields, *own: Constraint | None
) -> Constraint | None:
    """The one constraint of a request: its grammar fields' or ``own``'s (the API's own fields',
    each naming its field), None for free text. RequestError for two, for one of a kind no sampler
    plugin enforces, and for a ``json`` that is not JSON text."""
    found = [constraint for constraint in own if constraint is not None]
    found += grammar_constraints(fields)
    if len(found) > 1:
        names = " and ".join(str(constraint.field) for constraint in found)
        raise RequestError(
            f"send one output constraint per request, not {names}", field=found[1].field
        )
    if not found:
        return None
    constraint = found[0]
    if not constraints_supported(ctx, constraint.kind):
        raise RequestError(
            f"{constraint.field} is not supported by this server "
            f"(no sampler plugin enforces {constraint.kind} constraints)",
            field=constraint.field,
        )
    return constraint


def grammar_constraints(fields: GrammarFields) -> list[Constraint]:
    """A constraint for each grammar field the request sets."""
    found = []
    outputs = fields.structured_outputs
    if outputs is not None:
        found += _constraints(
            "structured_outputs.", json=outputs.json, regex=outputs.regex, choice=outputs.choice,
            grammar=outputs.grammar,
        )
        if outputs.json_object:
            found.append(Constraint("json_object", field="structured_outputs.json_object"))
        if not found:
            raise RequestError(
                "structured_outputs needs one of json, regex, choice, grammar or json_object",
                field="structured_outputs",
            )
    found += _constraints(
        "guided_", json=fields.guided_json, regex=fields.guided_regex, choice=fields.guided_choice,
        grammar=fields.guided_grammar,
    )
    if fields.grammar is not None:
        found.append(Constraint("gbnf", fields.grammar, field="grammar"))
    if fields.json_schema is not None:
        found.append(Constraint("json_schema", fields.json_schema, field="json_schema"))
    return found


def _constraints(
    prefix: str,
    *,
    json: Schema | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
) -> list[Constraint]:
    """vLLM's four kinds, named ``prefix`` + the kind (``structured_outputs.`` or ``guided_``)."""
    found = []
    if json is not None:
        schema = _schema(json, prefix + "json")
        found.append(Constraint("json_schema", schema, field=prefix + "json"))
    if regex is not None:
        found.append(Constraint("regex", regex, field=prefix + "regex"))
    if choice is not None:
        found.append(Constraint("choice", list(choice), field=prefix + "choice"))
    if grammar is not None:
        found.append(Constraint("gbnf", grammar, field=prefix + "grammar"))
    return found


def _schema(schema: Schema, field: str) -> Any:
    """A schema given as JSON text decoded, bounded in depth as a request body is."""
    if not isinstance(schema, str):
        return schema
    if body_depth(schema.encode()) > MAX_BODY_DEPTH:
        raise RequestError(f"this JSON schema nests deeper than {MAX_BODY_DEPTH}", field=field)
    try:
        return msgspec.json.decode(schema)
    except msgspec.DecodeError as exc:
        raise RequestError(f"this JSON schema text is not JSON: {exc}", field=field) from None
