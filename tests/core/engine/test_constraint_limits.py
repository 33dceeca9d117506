"""Output constraints measured before the grammar library sees them
(:mod:`mlxr_core.engine.constraint_limits`): the shapes that crashed or stalled the server in issue
42 (a ``$defs`` chain 3,000 deep, 3,000 Lark rules each reaching the next, 20,000 GBNF rules, a
100,000-option choice, a 1 MB grammar) are refused naming the limit, and what real clients send is
measured as it is."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxr_core.config.loader import load_config
from mlxr_core.config.schema import ConstraintLimits
from mlxr_core.engine.constraint_limits import (
    CEILINGS,
    ConstraintSize,
    check_constraint,
    grammar_size,
    measure,
    regex_shape,
    schema_shape,
)
from mlxr_core.engine.request import Constraint
from mlxr_core.errors import ConfigError, RequestError

LIMITS = ConstraintLimits()


def defs_chain(n: int, link: Any = None) -> dict[str, Any]:
    """The issue's schema: ``d0`` holds ``d1`` ... holds ``dn``, each through a ``$ref``."""
    link = link or (lambda ref: {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]})
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    """The issue's Lark grammar: ``aI: "(" aI+1 ")" | "x"``."""
    return "\n".join(["start: a0", *(f'a{i}: "(" a{i + 1} ")" | "x"' for i in range(n)), f'a{n}: "x"'])


def refusal(constraint: Constraint, limits: ConstraintLimits = LIMITS) -> str:
    with pytest.raises(RequestError) as caught:
        check_constraint(constraint, limits)
    assert caught.value.field == constraint.field
    return str(caught.value)


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        # N1: the $defs chain as the issue sent it (286 KB), and written compactly (under the byte limit).
        (Constraint("json_schema", defs_chain(3000), field="response_format"), "max_bytes (131,072)"),
        (Constraint("json_schema", defs_chain(1000, lambda ref: {"$ref": ref}), field="format"), "max_depth (256)"),
        (Constraint("json_schema", defs_chain(1000, lambda ref: {"anyOf": [{"$ref": ref}, {"type": "null"}]}),
                    field="format"), "following its $refs"),
        (Constraint("lark", lark_chain(3000), field="structured_outputs.grammar"), "max_depth (256)"),
        (Constraint("lark", "\n".join(["start: a0", *(f'a{i}: "x" a{i + 1}' for i in range(3000)), 'a3000: "y"']),
                    field="grammar"), "max_depth"),
        (Constraint("gbnf", "\n".join(["root ::= a0", *(f'a{i} ::= "x" a{i + 1}' for i in range(20_000)),
                                       'a20000 ::= "y"']), field="grammar"), "max_bytes"),
        (Constraint("gbnf", "\n".join(["root ::= " + " ".join(f"r{i}" for i in range(3000)),
                                       *(f'r{i} ::= "x"' for i in range(3000))]), field="grammar"), "max_rules (1,000)"),
        # N9: 100,000 choices, a 1 MB grammar of 110,000 alternatives, and a smaller one of 20,000.
        (Constraint("choice", [f"option {i}" for i in range(100_000)], field="structured_outputs.choice"), "max_bytes"),
        (Constraint("gbnf", "root ::= " + " | ".join(f'"alternative{i}"' for i in range(110_000)), field="grammar"),
         "max_bytes"),
        (Constraint("gbnf", "root ::= " + "|".join(f'"{i}"' for i in range(12_000)), field="grammar"),
         "12,000 alternatives, more than engine.constraint_limits.max_alternatives (10,000)"),
        (Constraint("choice", [str(i) for i in range(12_000)], field="guided_choice"), "max_alternatives"),
        (Constraint("regex", "(a{1024}){1024}", field="guided_regex"),
         "repeats 1,048,576 items (its counted repetitions multiplied), more than engine.constraint_limits.max_repetition"),
        (Constraint("json_schema", {"type": "string", "pattern": "^(ab{100}){1000}$"}, field="json_schema"),
         "max_repetition"),
        (Constraint("regex", "(" * 300 + "a" + ")" * 300, field="guided_regex"), "nests 301 levels"),
        (Constraint("lark", "start: %json " + json.dumps(defs_chain(100)), field="grammar"), "max_depth"),
    ],
)  # fmt: skip
def test_the_issues_constraints_are_refused_naming_the_limit(constraint: Constraint, says: str) -> None:
    message = refusal(constraint)
    assert says in message and "engine.constraint_limits." in message, message


def test_a_value_too_deep_to_encode_is_refused_as_too_deep() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert "nests too deep" in refusal(Constraint("json_schema", {"enum": [deep]}, field="f"))


@pytest.mark.parametrize(
    ("schema", "depth"),
    [
        ({"type": "integer"}, 1),
        ({"type": "object", "properties": {"a": {"type": "string"}}}, 3),
        # A recursive schema (a tree) counts its recursion once.
        ({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
          "$ref": "#/$defs/node"}, 6),
        ({"type": "object", "properties": {"next": {"$ref": "#"}}}, 3),
        # Each $ref followed is a level: pointers with escapes, anchors and $id.
        ({"$defs": {"a/b": {"$ref": "#/$defs/c~0d"}, "c~d": {"type": "integer"}}, "$ref": "#/$defs/a~1b"}, 5),
        ({"$defs": {"x": {"$anchor": "here", "type": "integer"}}, "$ref": "#here"}, 3),
        ({"$defs": {"x": {"$id": "item.json", "type": "integer"}}, "items": {"$ref": "item.json"}}, 4),
        ({"$ref": "#/$defs/missing"}, 1),
    ],
)  # fmt: skip
def test_a_schema_s_depth_follows_its_refs_and_counts_recursion_once(schema: dict[str, Any], depth: int) -> None:
    assert schema_shape(schema).depth == depth


def test_the_depth_grows_with_the_chain_and_the_walk_does_not_recurse() -> None:
    assert schema_shape(defs_chain(10)).depth == 43
    assert schema_shape(defs_chain(20_000, lambda ref: {"$ref": ref})).depth == 40_003


def test_alternatives_and_pattern_repetition_of_a_schema() -> None:
    schema = {"anyOf": [{"enum": ["a", "b", "c"]}, {"type": "string", "pattern": "x{3}(yz){2}"}],
              "patternProperties": {"^k{40}$": {}}}  # fmt: skip
    assert schema_shape(schema) == schema_shape(schema) and schema_shape(schema).alternatives == 5
    assert schema_shape(schema).repetition == 40


@pytest.mark.parametrize(
    ("pattern", "depth", "alternatives", "repetition"),
    [
        ("abc", 1, 1, 0),
        (r"(\d{1,3}\.){3}\d{1,3}", 2, 1, 12),
        ("[(|)]{5}", 1, 1, 5),  # a class holds no groups nor alternatives
        (r"\(\|\)", 1, 1, 0),
        ("(a|b|(c))", 3, 3, 0),
        ("a{3,}x{2,9}", 1, 1, 9),
        ("(a{1024}){1024}", 2, 1, 1024 * 1024),
    ],
)
def test_a_pattern_s_groups_alternatives_and_repetition(pattern: str, depth: int, alternatives: int, repetition: int) -> None:
    shape = regex_shape(pattern)
    assert (shape.depth, shape.alternatives, shape.repetition) == (depth, alternatives, repetition)


def test_a_lark_grammar_s_rules_references_and_what_holds_no_rules() -> None:
    grammar = "\n".join([
        "%llguidance {}",
        'start: greeting " " name+ | "(" start ")"   // start: x | y',
        '?greeting.2: "hello: a | b" | "hi"',
        "name: NAME | [title] NAME",
        'title: "dr" | /(m(r|s))/',
        "NAME: /[a-z]+/",
        '%import common.WS',
        "%ignore WS",
    ])  # fmt: skip
    size = grammar_size(grammar, lark=True)
    # start -> name -> [title] -> title: three rules deep, and the optional brackets' level.
    assert (size.rules, size.depth) == (5, 4)
    assert size.alternatives == 4 + 5  # the | outside literals, comments and the regex, one per rule


def test_a_gbnf_grammar_s_rules_span_lines_and_names_may_hold_dashes() -> None:
    grammar = 'root ::= item-list "."\nitem-list ::= ( item ( ", " item )* )\n   | "none" # root ::= x\nitem ::= [a-z|]+'
    size = grammar_size(grammar, lark=False)
    assert (size.rules, size.depth, size.alternatives) == (3, 5, 4)


def test_repetition_in_a_grammar_multiplies_within_a_rule() -> None:
    assert grammar_size('start: ("x"~100)~100 | /a{7}/', lark=True).repetition == 10_000
    assert grammar_size('root ::= ("x"{100}){100} "y"', lark=False).repetition == 10_000
    assert grammar_size('root ::= "x" "y" ("z" | [a-z])', lark=False).repetition == 0
    assert grammar_size("start: T\nT: (\"x\" \"y\"){10,20}", lark=True).repetition == 40


def test_a_real_schema_is_measured_small() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 100000}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                       "when": {"type": "string", "format": "date-time"}},
        "required": ["name"],
    }  # fmt: skip
    size = check_constraint(Constraint("json_schema", schema), LIMITS)
    assert size == ConstraintSize(size.bytes, 5, 0, 2, 0)


@pytest.mark.parametrize("value", [None, ["not", "a", "schema"], 5])
def test_a_malformed_value_is_measured_for_the_sampler_to_refuse(value: Any) -> None:
    assert measure(Constraint("json_schema", value)).bytes > 0
    assert measure(Constraint("gbnf", value)).rules == 0


def test_the_limits_are_config_and_capped_at_the_ceilings(tmp_path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("models: [{path: m.gguf}]\nengine:\n  constraint_limits: {max_depth: 64, max_rules: 50}\n")
    limits = load_config(path).engine.constraint_limits
    assert (limits.max_depth, limits.max_rules, limits.max_bytes) == (64, 50, LIMITS.max_bytes)
    path.write_text(f"models: [{{path: m.gguf}}]\nengine:\n  constraint_limits: {{max_depth: {CEILINGS.max_depth + 1}}}\n")
    with pytest.raises(ConfigError, match="max_depth"):
        load_config(path)
