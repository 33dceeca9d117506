"""Structured output: the grammar mask on the toy vocabulary, and JSON through the engine on a tiny
random model (whatever the weights say, the output parses and validates)."""

from __future__ import annotations

import json
import re

import attrs
import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.engine.decoding import SamplerContext, make_sampler
from mlxr_core.engine.request import (
    Constraint,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
)
from mlxr_core.errors import RequestError
from mlxr_plugins.samplers.structured import GrammarMask, structured

COLOURS = {"enum": ["red", "green"]}
#: Bounded: enums, small integers, short strings, a short array; nested.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["w"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["colour", "size", "tags"],
    "additionalProperties": False,
}  # fmt: skip


def mask_for(tokenizer, constraint: Constraint) -> GrammarMask:
    mask = structured(SamplingParams(constraint=constraint), SamplerContext(tokenizer=tokenizer))
    assert isinstance(mask, GrammarMask)
    return mask


def allowed_pieces(mask: GrammarMask, tokenizer) -> set[bytes]:
    pieces = tokenizer.token_bytes().pieces
    return {pieces[i] for i in np.nonzero(mask.allowed(len(pieces)))[0]}


def test_no_constraint_means_no_processor(toy_tokenizer):
    assert structured(SamplingParams(), SamplerContext(tokenizer=toy_tokenizer)) is None


def test_the_mask_allows_exactly_the_tokens_that_keep_the_output_valid(toy_tokenizer):
    mask = mask_for(toy_tokenizer, Constraint("json_schema", COLOURS))
    pieces = toy_tokenizer.token_bytes().pieces
    allowed = allowed_pieces(mask, toy_tokenizer)
    # Every token that is a prefix of a valid document, and nothing else.
    expected = {p for p in pieces if p and (b'"red"'.startswith(p) or b'"green"'.startswith(p))}
    assert allowed == expected and b'"' in allowed

    logits = mx.random.normal((1, len(pieces)))
    masked = np.array(mask(logits))
    keep = mask.allowed(len(pieces))
    assert np.all(np.isneginf(masked[0, ~keep]))
    np.testing.assert_array_equal(masked[0, keep], np.array(logits)[0, keep])


def test_accept_advances_the_grammar_and_a_complete_document_allows_only_eos(toy_tokenizer):
    mask = mask_for(toy_tokenizer, Constraint("json_schema", COLOURS))
    pieces = toy_tokenizer.token_bytes().pieces
    text = b""
    for token in toy_tokenizer.encode('"green"', add_special_tokens=False):
        allowed = allowed_pieces(mask, toy_tokenizer)
        assert pieces[token] in allowed
        assert all(b'"red"'.startswith(text + p) or b'"green"'.startswith(text + p) for p in allowed)
        mask.accept(token)
        text += pieces[token]
    assert text == b'"green"'
    keep = mask.allowed(len(pieces) + 5)  # wider logits than the vocabulary: extra rows masked
    assert set(np.nonzero(keep)[0]) == set(toy_tokenizer.eos_token_ids)


def test_a_regex_constraint_walks_the_same_way(toy_tokenizer):
    mask = mask_for(toy_tokenizer, Constraint("regex", "[0-9]{2}"))
    digits = {str(d).encode() for d in range(10)}
    assert allowed_pieces(mask, toy_tokenizer) <= digits | {p for p in toy_tokenizer.token_bytes().pieces
                                                            if len(p) == 2 and p.isdigit()}
    for token in toy_tokenizer.encode("42", add_special_tokens=False):
        mask.accept(token)
    assert set(np.nonzero(mask.allowed(toy_tokenizer.vocab_size))[0]) == set(toy_tokenizer.eos_token_ids)


def test_the_sampler_chain_draws_only_allowed_tokens(toy_tokenizer, plugin_host):
    params = SamplingParams(temperature=1.0, seed=3, constraint=Constraint("json_object"))
    context = SamplerContext(tokenizer=toy_tokenizer, vocab_size=toy_tokenizer.vocab_size)
    sampler = make_sampler(params, plugin_host.registries.samplers, context)
    assert sampler.stateful
    token = int(sampler(mx.random.normal((1, toy_tokenizer.vocab_size)))[0])
    assert toy_tokenizer.token_bytes().pieces[token] == b"{"


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "format": "not-a-format"}, "not-a-format"),
        ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        # A schema asking to be compiled leniently still is not.
        ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
    ],
)
def test_unsupported_schema_features_are_a_request_error_naming_them(toy_tokenizer, schema, feature):
    params = SamplingParams(constraint=Constraint("json_schema", schema, field="response_format"))
    with pytest.raises(RequestError, match=feature) as caught:
        structured.validate(params, SamplerContext(tokenizer=toy_tokenizer))  # type: ignore[attr-defined]
    assert caught.value.field == "response_format"  # the constraint's field, whatever the API


@pytest.mark.parametrize(
    "constraint",
    [Constraint("json_schema", ["not", "a", "schema"]), Constraint("regex", "(unclosed"),
     Constraint("lark", "start: ("), Constraint("yaml", "x"),
     # GBNF the converter refuses (bare Exception, IndexError ... inside), and one llguidance does
     Constraint("gbnf", "root ::= ("), Constraint("gbnf", 'root ::= "\\'), Constraint("gbnf", "root ::= other"),
     Constraint("gbnf", ""), Constraint("gbnf", 'root ::= [a-'), Constraint("gbnf", 5),
     Constraint("choice", []), Constraint("choice", ["a", 1]), Constraint("choice", "a")],
)  # fmt: skip
def test_malformed_constraints_are_request_errors_naming_the_field(toy_tokenizer, constraint):
    constraint = attrs.evolve(constraint, field="the_field")
    with pytest.raises(RequestError) as caught:
        structured.validate(SamplingParams(constraint=constraint), SamplerContext(tokenizer=toy_tokenizer))  # type: ignore[attr-defined]
    assert caught.value.field == "the_field"


def test_the_sampler_plugin_declares_the_kinds_it_enforces(plugin_host):
    entry = plugin_host.registries.samplers.entry("structured")
    assert set(entry.meta["constraints"]) == {"json_object", "json_schema", "regex", "lark", "gbnf", "choice"}


def test_a_choice_allows_exactly_its_strings(toy_tokenizer):
    choices = ["yes", "no", 'a "quoted"\nline', ""]
    mask = mask_for(toy_tokenizer, Constraint("choice", choices))
    assert set(np.nonzero(mask.allowed(toy_tokenizer.vocab_size))[0]) >= set(toy_tokenizer.eos_token_ids)  # ""
    for token in toy_tokenizer.encode(choices[2], add_special_tokens=False):
        assert toy_tokenizer.token_bytes().pieces[token] in allowed_pieces(mask, toy_tokenizer)
        mask.accept(token)
    assert set(np.nonzero(mask.allowed(toy_tokenizer.vocab_size))[0]) == set(toy_tokenizer.eos_token_ids)


def test_a_gbnf_grammar_is_read_as_gbnf_and_a_lark_one_as_lark(toy_tokenizer):
    for grammar in ('root ::= ("yes" | "no") [0-9]', 'start: ("yes" | "no") /[0-9]/'):
        mask = mask_for(toy_tokenizer, Constraint("gbnf", grammar))
        assert {b"y", b"n"} <= allowed_pieces(mask, toy_tokenizer) <= {b"y", b"ye", b"yes", b"n", b"no"}


# -- through the engine --------------------------------------------------------------------------


def generate(engine, constraint, *, seed, max_tokens=100):
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, constraint=constraint)
    handle = engine.submit(GenerationRequest(model="tiny", prompt_ids=[5, 6, 7], params=params))
    events = list(handle)
    assert isinstance(events[-1], Finished), events[-1]
    return "".join(e.text for e in events if isinstance(e, Delta)), events[-1].reason


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_random_model_writes_json_that_validates_against_the_schema(tiny_engine, seed):
    text, reason = generate(tiny_engine, Constraint("json_schema", BOUNDED_SCHEMA), seed=seed)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)


def test_a_regex_constraint_through_the_engine(tiny_engine):
    text, reason = generate(tiny_engine, Constraint("regex", "(yes|no), [a-c]{3}"), seed=5)
    assert reason == "stop"
    assert re.fullmatch("(yes|no), [a-c]{3}", text), text


def test_an_unsupported_schema_is_refused_at_submit(tiny_engine):
    params = SamplingParams(constraint=Constraint("json_schema", {"type": "array", "uniqueItems": True}))
    with pytest.raises(RequestError, match="uniqueItems"):
        tiny_engine.submit(GenerationRequest(model="tiny", prompt_ids=[5, 6, 7], params=params))


def test_max_tokens_before_the_document_ends_finishes_with_length(tiny_engine):
    text, reason = generate(tiny_engine, Constraint("json_schema", BOUNDED_SCHEMA), seed=0, max_tokens=4)
    assert reason == "length"
    assert text.startswith('{"')  # a truncated prefix of a valid document


def test_a_schema_that_requires_itself_ends_the_request_with_an_error(tiny_engine):
    """llguidance gives up on it (too complex) after the first token; the request must fail, not
    go on with whatever the unconstrained model writes."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, constraint=Constraint("json_schema", schema))
    events = list(tiny_engine.submit(GenerationRequest(model="tiny", prompt_ids=[5, 6, 7], params=params)))
    assert isinstance(events[-1], Failed), events[-1]
    assert isinstance(events[-1].error, RequestError) and "can no longer be enforced" in str(events[-1].error)
    assert generate(tiny_engine, Constraint("regex", "(yes|no)"), seed=1)[1] == "stop"  # the engine serves on
