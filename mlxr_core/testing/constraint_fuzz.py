"""A fuzzer of output constraints: JSON schemas, Lark and GBNF grammars, regular expressions and
choice lists grown in size and depth until the server refuses them.

Each of :data:`FAMILIES` builds a constraint of size ``n`` (a ``$defs`` chain ``n`` deep, ``n``
rules each reaching the next, ``n`` alternatives ...); :func:`ladders` grows every family by
doubling ``n`` until it is refused. :func:`run_in_child` submits the ladders to an engine (a thread,
or a process of its own: ``engine.core``) serving a tiny model, in one child process, so a crash is
a finding rather than the end of the caller; :func:`problems` says what went wrong: a child that
died, an error that is not a 400, a refusal carrying a panic or a backtrace, a constraint held past
the time bound, a family never refused. The CI runs small limits
(``tests/plugins/samplers/test_constraint_fuzz.py``); ``bench/fuzz_constraints.py`` the defaults
and the ceilings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

#: What one family builds at size ``n``: a constraint's kind and value.
Builder = Callable[[int], tuple[str, Any]]


def _defs(n: int, link: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _nested(n: int, wrap: Callable[[Any], Any], inner: Any) -> Any:
    for _ in range(n):
        inner = wrap(inner)
    return inner


FAMILIES: dict[str, Builder] = {
    # JSON schemas: $defs chains (the issue's), nesting, width.
    "json_defs_chain": lambda n: ("json_schema", _defs(n, lambda ref: {
        "type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]})),
    "json_anyof_chain": lambda n: ("json_schema", _defs(n, lambda ref: {"anyOf": [{"$ref": ref}, {"type": "null"}]})),
    "json_items_chain": lambda n: ("json_schema", _defs(n, lambda ref: {"type": "array", "items": {"$ref": ref}})),
    "json_ref_chain": lambda n: ("json_schema", _defs(n, lambda ref: {"$ref": ref})),
    "json_nesting": lambda n: ("json_schema", _nested(n, lambda s: {
        "type": "object", "properties": {"a": s}, "required": ["a"]}, {"type": "integer"})),
    "json_allof_nesting": lambda n: ("json_schema", _nested(n, lambda s: {"allOf": [s]}, {"type": "string"})),
    "json_wide": lambda n: ("json_schema", {
        "$defs": {f"d{i}": {"type": "integer", "minimum": i} for i in range(n)},
        "type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(n)}}),
    "json_enum": lambda n: ("json_schema", {"enum": [f"value {i}" for i in range(n)]}),
    # Lark: the issue's rule chain, a sequence chain, terminals, parentheses, width, an inner schema.
    "lark_rule_chain": lambda n: ("lark", "\n".join(
        ["start: a0", *(f'a{i}: "(" a{i + 1} ")" | "x"' for i in range(n)), f'a{n}: "x"'])),
    "lark_sequence_chain": lambda n: ("lark", "\n".join(
        ["start: a0", *(f'a{i}: "x" a{i + 1}' for i in range(n)), f'a{n}: "y"'])),
    "lark_terminal_chain": lambda n: ("lark", "\n".join(
        ["start: T0", *(f'T{i}: "x" T{i + 1}' for i in range(n)), f'T{n}: "y"'])),
    "lark_parentheses": lambda n: ("lark", "start: " + "(" * n + '"x"' + ")" * n),
    "lark_alternatives": lambda n: ("lark", "start: " + " | ".join(f'"a{i}"' for i in range(n))),
    "lark_rules": lambda n: ("lark", "\n".join(
        ["start: " + " | ".join(f"r{i}" for i in range(n)), *(f'r{i}: "a{i}"' for i in range(n))])),
    "lark_json_chain": lambda n: ("lark", "start: %json " + json.dumps(_defs(n, lambda ref: {
        "type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}))),
    # GBNF: the issue's rule chain, width, parentheses.
    "gbnf_rule_chain": lambda n: ("gbnf", "\n".join(
        ["root ::= a0", *(f'a{i} ::= "x" a{i + 1}' for i in range(n)), f'a{n} ::= "y"'])),
    "gbnf_alternatives": lambda n: ("gbnf", "root ::= " + " | ".join(f'"a{i}"' for i in range(n))),
    "gbnf_parentheses": lambda n: ("gbnf", "root ::= " + "(" * n + '"x"' + ")" * n),
    # Regular expressions: groups, alternatives, repetition.
    "regex_groups": lambda n: ("regex", "(" * n + "a" + ")" * n),
    "regex_alternatives": lambda n: ("regex", "|".join(f"a{i}" for i in range(n))),
    "regex_repetition": lambda n: ("regex", f"(a{{{n}}}){{{n}}}"),
    # Choices (the issue's 100,000).
    "choice": lambda n: ("choice", [f"option {i}" for i in range(n)]),
}  # fmt: skip


def ladders(families: list[str] | None = None, top: int = 2**17) -> Iterator[tuple[str, int]]:
    """``(family, n)`` for every family (all, or those named), ``n`` doubling from 1 to ``top``;
    the caller stops a family at its first refusal."""
    for family in families or list(FAMILIES):
        n = 1
        while n <= top:
            yield family, n
            n *= 2


def child_main() -> None:
    """The fuzzing child: reads ``{"model", "core", "limits", "families", "top"}`` on stdin, serves
    the model with those limits and writes one JSON line before (``started``) and after each case."""
    request = json.loads(sys.stdin.read())
    from mlxr_core.config.schema import Config, ConstraintLimits, EngineConfig, ModelConfig
    from mlxr_core.engine.remote import make_engine
    from mlxr_core.engine.request import Constraint, Failed, GenerationRequest, SamplingParams
    from mlxr_core.errors import MlxrError
    from mlxr_core.plugins import load_plugins

    limits = ConstraintLimits(**request["limits"])
    config = Config(
        models=[ModelConfig(path=request["model"], name="tiny", context_length=128)],
        engine=EngineConfig(core=request["core"], constraint_limits=limits),
    )
    engine = make_engine(config, load_plugins())
    engine.start()
    refused: set[str] = set()
    try:
        for family, n in ladders(request["families"], request["top"]):
            if family in refused:
                continue
            kind, value = FAMILIES[family](n)
            print(json.dumps({"started": True, "family": family, "n": n}), flush=True)
            params = SamplingParams(max_tokens=2, constraint=Constraint(kind, value, field=family))
            started = time.perf_counter()
            outcome: dict[str, Any] = {"family": family, "n": n}
            try:
                handle = engine.submit(GenerationRequest(model="tiny", prompt_ids=[1, 2, 3], params=params))
                failed = [event for event in handle if isinstance(event, Failed)]
                outcome["result"] = "failed" if failed else "accepted"
                if failed:
                    outcome["message"] = str(failed[0].error)
            except MlxrError as exc:
                outcome.update(result="refused", status=exc.status, message=str(exc))
                refused.add(family)
            except Exception as exc:  # a finding: anything else is a 500
                outcome.update(result="error", message=f"{type(exc).__name__}: {exc}")
                refused.add(family)
            outcome["seconds"] = round(time.perf_counter() - started, 3)
            print(json.dumps(outcome), flush=True)
    finally:
        engine.stop()


def run_in_child(
    model: str,
    *,
    core: str = "thread",
    limits: dict[str, Any] | None = None,
    families: list[str] | None = None,
    top: int = 2**17,
    timeout: float = 600,
) -> tuple[list[dict[str, Any]], str | None]:
    """Every ladder submitted in one child process (:func:`child_main`): the outcome of each case,
    and, when the child died, the case it died on and how."""
    request = {"model": model, "core": core, "limits": limits or {}, "families": families, "top": top}
    process = subprocess.run(
        [sys.executable, "-c", "from mlxr_core.testing.constraint_fuzz import child_main; child_main()"],
        input=json.dumps(request), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    outcomes: list[dict[str, Any]] = []
    last = None
    for line in process.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.pop("started", False):
            last = record
        else:
            outcomes.append(record)
    death = None
    if process.returncode != 0:
        death = f"the fuzzing process died ({process.returncode}) on {last}:\n{process.stderr[-2000:]}"
    return outcomes, death


def problems(outcomes: list[dict[str, Any]], *, bound: float, families: list[str] | None = None) -> list[str]:
    """What is wrong in ``outcomes``: a case that was not answered with a 400 or accepted, a
    refusal or failure carrying a panic, a backtrace or several lines, a case that took longer than
    ``bound`` seconds, a family (of ``families``, all by default) never refused."""
    found = []
    for outcome in outcomes:
        name = f"{outcome['family']} n={outcome['n']}"
        message = outcome.get("message", "")
        if outcome["result"] == "error" or (outcome["result"] == "refused" and outcome.get("status") != 400):
            found.append(f"{name}: not a 400: {message[:300]}")
        if any(word in message.lower() for word in ("panic", "backtrace", "traceback")) or "\n" in message:
            found.append(f"{name}: the message carries the library's internals: {message[:300]!r}")
        if outcome["seconds"] > bound:
            found.append(f"{name}: {outcome['seconds']} s, past the {bound} s bound")
    refused = {outcome["family"] for outcome in outcomes if outcome["result"] != "accepted"}
    found += [f"{family}: never refused" for family in families or list(FAMILIES) if family not in refused]
    return found
