"""A client's constraint made into a grammar where the library cannot take the server down
(:mod:`mlxr_plugins.samplers.grammars`): measured first, then converted and validated in a child
process whose crash or runaway is a 400 naming no backtrace; results kept by digest."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from mlxr_core.config.schema import ConstraintLimits
from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import Constraint, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_plugins.samplers import grammars
from mlxr_plugins.samplers.grammars import (
    Checked,
    GrammarCheckers,
    checked_grammar,
    first_line,
    on_large_stack,
)
from mlxr_plugins.samplers.structured import structured


def defs_chain(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}  # fmt: skip
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= a0", *(f'a{i} ::= "x" a{i + 1}' for i in range(n)), f'a{n} ::= "y"'])


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammars, "_known", grammars._Cache())


class CountingCheckers:
    """Stands in for the child processes: counts what reaches them, answers ``answer``."""

    def __init__(self, answer: Checked | None = None):
        self.answer = answer
        self.seen: list[Constraint] = []

    def check(self, constraint: Constraint, timeout: float) -> Checked | None:
        self.seen.append(constraint)
        return self.answer or Checked(grammar=grammars.grammar_text(constraint))


def test_a_crash_in_the_library_is_a_400_and_the_checker_starts_again(caplog: pytest.LogCaptureFixture) -> None:
    """A checker whose checks run on a 256 KiB stack: a 100-deep $defs chain overflows it."""
    checkers = GrammarCheckers(processes=1, stack_bytes=256 * 2**10)
    try:
        with caplog.at_level(logging.WARNING):
            crashed = checkers.check(Constraint("json_schema", defs_chain(100), field="response_format"), 30.0)
        assert crashed is not None and crashed.lasting
        assert crashed.error == ("this JSON schema cannot be enforced: the grammar library failed on it; "
                                 "send a smaller or simpler one")  # fmt: skip
        assert "SIGSEGV" in caplog.text and "response_format" in caplog.text
        fine = checkers.check(Constraint("json_schema", defs_chain(2)), 30.0)
        assert fine is not None and fine.error is None and fine.grammar
    finally:
        checkers.close()


def test_a_runaway_conversion_is_killed_at_the_timeout() -> None:
    """llguidance's GBNF converter is quadratic in rules: 2,000 of them take seconds."""
    checkers = GrammarCheckers(processes=1)
    try:
        checkers.check(Constraint("regex", "a"), 60.0)  # started: its start is not the timeout's
        slow = checkers.check(Constraint("gbnf", gbnf_chain(2000), field="grammar"), 0.2)
        assert slow is not None and not slow.lasting
        assert slow.error is not None and "took longer than 0.2 s to compile" in slow.error
        assert "compile_timeout_s" in slow.error
        again = checkers.check(Constraint("regex", "[0-9]+"), 60.0)
        assert again is not None and again.error is None
    finally:
        checkers.close()


def test_a_refusal_by_the_library_is_its_first_line() -> None:
    checkers = GrammarCheckers(processes=1)
    try:
        refused = checkers.check(Constraint("json_schema", {"type": "array", "uniqueItems": True}), 60.0)
        assert refused is not None and refused.error == 'this JSON schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'
        malformed = checkers.check(Constraint("gbnf", "root ::= (", field="grammar"), 60.0)
        assert malformed is not None and malformed.error is not None and malformed.error.startswith("this GBNF grammar does not parse")
    finally:
        checkers.close()


@pytest.mark.parametrize(
    ("message", "line"),
    [
        # N9: what llguidance says of a grammar of 110,000 alternatives.
        ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n 0: <unknown>\n 1: <unknown>",
         "the grammar library gave up on it (too large or too complex); send a smaller or simpler one"),
        ("thread '<unnamed>' panicked at src/lib.rs:10:5:\nboom", "the grammar library gave up on it"),
        ("regex parse error:\n    (?=a)b\n    ^^^\nerror: look-around, including look-ahead and look-behind, is not supported",
         "regex parse error: error: look-around, including look-ahead and look-behind, is not supported"),
        ("1(7): lark grammar too deeply nested\n   1 | start: ((((\n          ^", "1(7): lark grammar too deeply nested"),
        ("", "rejected"),
    ],
)  # fmt: skip
def test_only_the_first_line_of_a_library_error_is_told(message: str, line: str) -> None:
    assert first_line(message).startswith(line)
    assert "\n" not in first_line(message) and "backtrace" not in first_line(message)


def test_the_issue_s_constraints_never_reach_the_library(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    def no(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("reached the library")

    monkeypatch.setattr(grammars, "checkers", no)
    monkeypatch.setattr(grammars, "load_llguidance", no)
    limits = ConstraintLimits()
    for constraint, says in [
        (Constraint("json_schema", defs_chain(3000), field="response_format"), "max_bytes"),
        (Constraint("json_schema", defs_chain(700), field="format"), "max_depth"),
        (Constraint("lark", "\n".join(["start: a0", *(f'a{i}: "(" a{i + 1} ")" | "x"' for i in range(3000)),
                                       'a3000: "x"']), field="structured_outputs.grammar"), "max_depth"),
        (Constraint("gbnf", gbnf_chain(20_000), field="grammar"), "max_bytes"),
        (Constraint("choice", [f"option {i}" for i in range(100_000)], field="structured_outputs.choice"), "max_bytes"),
        (Constraint("gbnf", "root ::= " + " | ".join(f'"a{i}"' for i in range(110_000)), field="grammar"), "max_bytes"),
    ]:  # fmt: skip
        with pytest.raises(RequestError, match=f"engine.constraint_limits.{says}") as caught:
            checked_grammar(constraint, limits, isolate=True)
        assert caught.value.field == constraint.field


def test_a_constraint_is_checked_once_and_known_by_its_digest(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    fake = CountingCheckers()
    monkeypatch.setattr(grammars, "checkers", lambda: fake)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = checked_grammar(Constraint("json_schema", schema, field="a"), isolate=True)
    again = checked_grammar(Constraint("json_schema", dict(schema), field="b"), isolate=True)
    assert first == again and len(fake.seen) == 1
    # Tighter limits still apply to a known constraint.
    with pytest.raises(RequestError, match="max_depth"):
        checked_grammar(Constraint("json_schema", schema), ConstraintLimits(max_depth=2), isolate=True)


def test_a_lasting_refusal_is_remembered_and_a_timeout_is_not(monkeypatch: pytest.MonkeyPatch, fresh_cache: None) -> None:
    fake = CountingCheckers(Checked(error="this grammar cannot be enforced: no"))
    monkeypatch.setattr(grammars, "checkers", lambda: fake)
    for field in ("one", "two"):
        with pytest.raises(RequestError, match="no") as caught:
            checked_grammar(Constraint("regex", "a+", field=field), isolate=True)
        assert caught.value.field == field
    assert len(fake.seen) == 1
    fake.answer = Checked(error="took too long", lasting=False)
    for _ in range(2):
        with pytest.raises(RequestError, match="took too long"):
            checked_grammar(Constraint("regex", "b+"), isolate=True)
    assert len(fake.seen) == 3


def test_the_library_runs_on_a_large_stack_and_the_default_is_restored() -> None:
    before = threading.stack_size()
    assert on_large_stack(lambda: threading.current_thread().name) == "mlxr-grammar"
    with pytest.raises(ZeroDivisionError):
        on_large_stack(lambda: 1 / 0)
    assert threading.stack_size() == before


def test_submit_refuses_a_huge_choice_naming_the_limit(toy_tokenizer: Any, fresh_cache: None) -> None:
    """N9: 100,000 choices took 8 s to compile and answered a Rust panic; now the bytes refuse them."""
    params = SamplingParams(constraint=Constraint("choice", [f"option {i}" for i in range(100_000)], field="guided_choice"))
    with pytest.raises(RequestError, match=r"is 1,488,891 bytes, more than engine\.constraint_limits\.max_bytes") as caught:
        structured.validate(params, SamplerContext(tokenizer=toy_tokenizer, constraint_limits=ConstraintLimits()))  # type: ignore[attr-defined]
    assert caught.value.field == "guided_choice"
