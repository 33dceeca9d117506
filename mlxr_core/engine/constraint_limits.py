"""How large and how deep a request's output constraint is, measured before any grammar library
sees it, and the 400 for one past the server's :class:`~mlxr_core.config.schema.ConstraintLimits`.

The grammar library (llguidance) recurses once per level of a grammar while it checks one: a JSON
schema whose ``$defs`` chain a few thousand ``$ref`` deep, or a Lark grammar of a few thousand rules
each reaching the next, overflows a thread's stack and kills the process; a 100,000-option choice
takes seconds to compile. So every constraint is measured here first, in pure Python and in
milliseconds: its bytes, its nesting (following ``$ref`` and rule references, with recursion
counted once), its rules and its alternatives. None of this imports the library.
"""

from __future__ import annotations

import hashlib
import json
import re
from bisect import bisect_left
from typing import Any
from urllib.parse import unquote

import attrs
import msgspec

from mlxr_core.config.schema import ConstraintLimits
from mlxr_core.engine.request import Constraint
from mlxr_core.errors import RequestError

#: The largest value of each limit a config may set (and what the sampler enforces when it is
#: given none): depths below what llguidance survives on a 16 MiB stack with room to spare, sizes
#: whose compiling stays within seconds (bench/fuzz_constraints.py --limits ceilings).
CEILINGS = ConstraintLimits(
    max_bytes=256 * 2**10, max_depth=1024, max_rules=10_000, max_alternatives=20_000,
    max_repetition=100_000, compile_timeout_s=600.0,
)  # fmt: skip
#: How a message names a constraint of each kind.
KIND_NAMES = {
    "json_schema": "JSON schema", "json_object": "JSON schema", "gbnf": "grammar", "lark": "grammar",
    "regex": "regular expression", "choice": "choice list",
}  # fmt: skip
_WHERE = "engine.constraint_limits"


@attrs.frozen
class ConstraintSize:
    """What :func:`measure` found: the sizes :class:`ConstraintLimits` bounds."""

    bytes: int
    depth: int = 0
    rules: int = 0
    alternatives: int = 0
    repetition: int = 0


def encoded(constraint: Constraint) -> bytes:
    """The constraint's value as bytes: a pattern or grammar as UTF-8, anything else (a schema, the
    choices) as compact JSON. RequestError for a value that is not JSON."""
    value = constraint.value
    if isinstance(value, str):
        return value.encode("utf-8", errors="surrogatepass")
    try:
        return msgspec.json.encode(value)
    except RecursionError:
        raise _too_deep(constraint, None, None) from None
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        raise RequestError(f"this {_what(constraint)} is not JSON: {exc}", field=constraint.field) from None


def constraint_key(constraint: Constraint, data: bytes | None = None) -> str:
    """A digest naming the constraint's kind and value (``data``: its :func:`encoded` bytes)."""
    data = encoded(constraint) if data is None else data
    return hashlib.sha256(constraint.kind.encode() + b"\0" + data).hexdigest()


def check_bytes(constraint: Constraint, data: bytes, limits: ConstraintLimits) -> None:
    """RequestError when the constraint's bytes pass ``limits.max_bytes``."""
    if len(data) > limits.max_bytes:
        raise RequestError(
            f"this {_what(constraint)} is {len(data):,} bytes, more than {_WHERE}.max_bytes "
            f"({limits.max_bytes:,}); send a smaller one",
            field=constraint.field,
        )


def check_size(constraint: Constraint, size: ConstraintSize, limits: ConstraintLimits) -> None:
    """RequestError naming the first of ``limits`` that ``size`` passes."""
    what, field = _what(constraint), constraint.field
    check_bytes(constraint, b"" if size.bytes <= limits.max_bytes else b" " * size.bytes, limits)
    if size.depth > limits.max_depth:
        raise _too_deep(constraint, size.depth, limits.max_depth)
    if size.rules > limits.max_rules:
        raise RequestError(
            f"this {what} has {size.rules:,} rules, more than {_WHERE}.max_rules ({limits.max_rules:,})",
            field=field,
        )
    if size.alternatives > limits.max_alternatives:
        raise RequestError(
            f"this {what} has {size.alternatives:,} alternatives, more than "
            f"{_WHERE}.max_alternatives ({limits.max_alternatives:,})",
            field=field,
        )
    if size.repetition > limits.max_repetition:
        raise RequestError(
            f"this {what} repeats {size.repetition:,} items (its counted repetitions multiplied), "
            f"more than {_WHERE}.max_repetition ({limits.max_repetition:,})",
            field=field,
        )


def check_constraint(constraint: Constraint, limits: ConstraintLimits) -> ConstraintSize:
    """Measure ``constraint`` (its bytes first, so a huge one costs no more) and refuse it with a
    RequestError naming the limit it passes; its size otherwise."""
    data = encoded(constraint)
    check_bytes(constraint, data, limits)
    size = measure(constraint, data)
    check_size(constraint, size, limits)
    return size


def measure(constraint: Constraint, data: bytes | None = None) -> ConstraintSize:
    """The sizes of ``constraint`` (``data``: its :func:`encoded` bytes, if known)."""
    data = encoded(constraint) if data is None else data
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "json_schema":
            shape = schema_shape(value)
            return ConstraintSize(len(data), shape.depth, 0, shape.alternatives, shape.repetition)
        if kind == "choice" and isinstance(value, list | tuple):
            return ConstraintSize(len(data), 1, 0, len(value))
        if kind == "regex" and isinstance(value, str):
            shape = regex_shape(value)
            return ConstraintSize(len(data), shape.depth, 0, shape.alternatives, shape.repetition)
        if kind in ("lark", "gbnf") and isinstance(value, str):
            lark = kind == "lark" or _LARK_SYNTAX.search(value) is not None
            return grammar_size(value, lark=lark, data_bytes=len(data))
    except RecursionError:
        raise _too_deep(constraint, None, None) from None
    return ConstraintSize(len(data))  # json_object, or a malformed value the sampler refuses


# -- JSON schemas ---------------------------------------------------------------------------


@attrs.frozen
class Shape:
    """A schema's, pattern's or grammar's nesting, alternatives and repetition (see
    :class:`~mlxr_core.config.schema.ConstraintLimits`)."""

    depth: int = 0
    alternatives: int = 0
    repetition: int = 0


def schema_shape(schema: Any) -> Shape:
    """The nesting of ``schema`` (each object and array one level, each ``$ref`` followed one more;
    a reference back into its own path, a recursive schema, counted once), its alternatives
    (``enum``, ``anyOf`` and ``oneOf`` entries) and the largest repetition of its ``pattern``s."""
    if not isinstance(schema, dict | list):
        return Shape()
    # Number every object and array, each with the numbers of those it holds.
    index: dict[int, int] = {id(schema): 0}
    nodes: list[Any] = [schema]
    children: list[list[int]] = []
    refs: list[tuple[int, str]] = []
    anchors: dict[str, Any] = {}
    alternatives = repetition = 0
    for number, node in enumerate(nodes):  # grows as it goes: breadth first, no recursion
        held = []
        for value in node.values() if type(node) is dict else node:
            if isinstance(value, dict | list):
                known = index.get(id(value))
                if known is None:
                    known = index[id(value)] = len(nodes)
                    nodes.append(value)
                held.append(known)
        children.append(held)
        if type(node) is dict and not _KEYWORDS.isdisjoint(node):
            for key in _ALTERNATIVES:
                if isinstance(node.get(key), list):
                    alternatives += len(node[key])
            if isinstance(node.get("$ref"), str):
                refs.append((number, node["$ref"]))
            for key in _NAMES:
                if isinstance(node.get(key), str) and node[key]:
                    anchors[node[key].lstrip("#")] = node
            patterns = [node.get("pattern"), *(node.get("patternProperties") or ())]
            for pattern in patterns:
                if isinstance(pattern, str):
                    repetition = max(repetition, regex_shape(pattern).repetition)
    extra = [[0] * len(held) for held in children]
    for number, ref in refs:
        target = index.get(id(_resolve(schema, anchors, ref)))
        if target is not None:
            children[number].append(target)
            extra[number].append(1)
    return Shape(_longest([0], [1] * len(nodes), children, extra), alternatives, repetition)


_ALTERNATIVES = ("enum", "anyOf", "oneOf")
_NAMES = ("$anchor", "$id", "id")
_KEYWORDS = frozenset((*_ALTERNATIVES, *_NAMES, "$ref", "pattern", "patternProperties"))


def _resolve(root: Any, anchors: dict[str, Any], ref: str) -> Any:
    """The node ``ref`` names in ``root`` (a JSON pointer, an anchor or an ``$id``), None if none."""
    document, _, fragment = ref.partition("#")
    node = root
    if document:
        node = anchors.get(document) or anchors.get(document.rsplit("/", 1)[-1])
        if node is None:
            return None
    if not fragment:
        return node
    if not fragment.startswith("/"):
        return anchors.get(unquote(fragment))
    for part in fragment[1:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | list) else None


def _longest(roots: list[int], base: list[int], children: list[list[int]], extra: list[list[int]]) -> int:
    """The deepest of ``roots`` in a graph of numbered nodes, without recursion: a node's depth is
    its ``base``, or one more than its deepest child's (plus that edge's ``extra`` levels) if that
    is more. A child already on the path (a cycle: recursion, which the library follows lazily)
    adds nothing."""
    depth = [0] * len(base)  # 0: not yet known
    on_path = [False] * len(base)
    next_child = [0] * len(base)
    for root in roots:
        if depth[root]:
            continue
        stack = [root]
        on_path[root] = True
        while stack:
            node = stack[-1]
            held = children[node]
            i = next_child[node]
            while i < len(held) and (depth[held[i]] or on_path[held[i]]):
                i += 1
            next_child[node] = i + 1
            if i < len(held):
                stack.append(held[i])
                on_path[held[i]] = True
                continue
            stack.pop()
            on_path[node] = False
            deepest = 0
            for child, levels in zip(held, extra[node], strict=True):
                if depth[child]:
                    deepest = max(deepest, depth[child] + levels)
            depth[node] = max(base[node], 1 + deepest)
    return max((depth[root] for root in roots), default=0)


# -- regular expressions ----------------------------------------------------------------------

_REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|\{([0-9]+)(?:,([0-9]*))?\}|[()|]|.", re.S)
#: Where a repetition count stops mattering (a product that large is refused whatever the limit).
_HUGE = 10**12


def regex_shape(pattern: str) -> Shape:
    """A pattern's deepest group nesting (one for the pattern itself), its alternatives (``|``
    outside character classes, plus one) and its repetition: the most items one counted repetition
    (``{n}``, ``{n,m}``, ``{n,}``) stands for, those nested in it multiplied."""
    counter = _Repetition()
    depth = deepest = 1
    bars = 0
    for match in _REGEX_TOKEN.finditer(pattern):
        token = match.group()
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
            counter.open()
        elif token == ")":
            depth = max(1, depth - 1)
            counter.close()
        elif token == "|":
            bars += 1
        elif match.group(1) is not None:
            counter.repeat(int(match.group(1)), match.group(2))
        else:
            counter.item()
    return Shape(deepest, bars + 1, counter.largest())


class _Repetition:
    """Items counted as a pattern or a rule is read, each counted repetition multiplying the item
    or group before it; :meth:`largest` is the most items one repetition stands for."""

    def __init__(self) -> None:
        self._groups: list[list[int]] = [[0, 0]]  # per open group: [its items so far, the last item's]
        self._largest = 0

    def item(self, count: int = 1) -> None:
        group = self._groups[-1]
        group[0] += count
        group[1] = count

    def open(self) -> None:
        self._groups.append([0, 0])

    def close(self) -> None:
        if len(self._groups) > 1:
            self.item(self._groups.pop()[0])

    def repeat(self, low: int, high: str | None) -> None:
        """The item before repeated ``low`` times, or up to ``high`` (``""``: no upper bound)."""
        times = max(low, int(high)) if high else low
        group = self._groups[-1]
        group[0] = min(_HUGE, group[0] + group[1] * (max(times, 1) - 1))
        group[1] = min(_HUGE, group[1] * max(times, 1))
        self._largest = max(self._largest, group[1])

    def largest(self) -> int:
        while len(self._groups) > 1:
            self.close()
        return self._largest


# -- Lark and GBNF grammars -------------------------------------------------------------------

#: How llguidance (and llama.cpp) tell a Lark grammar from a GBNF one.
_LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")
#: Comments (``//`` in Lark, ``#`` in GBNF), found past literals (group 1, kept) that may hold them.
_COMMENT = {
    True: re.compile(r'("(?:\\.|[^"\\\n])*"i?)|//[^\n]*'),
    False: re.compile(r'("(?:\\.|[^"\\\n])*"|\[(?:\\.|[^\]\\])*\])|\#[^\n]*'),
}
#: What holds no rules, each read as one item (``@``): Lark's literals, regular expressions (group
#: 1) and special tokens; GBNF's literals and character classes.
_OPAQUE = {
    True: re.compile(r'"(?:\\.|[^"\\\n])*"i?|/((?:\\.|[^/\\\n])+)/[imslux]*|<[^<>\n]*>'),
    False: re.compile(r'"(?:\\.|[^"\\\n])*"|\[(?:\\.|[^\]\\])*\]()'),
}
#: A rule's definition: Lark's ``name:`` (``?name``, ``!name``, ``name.2``) at a line's start, GBNF's
#: ``name ::=``.
_DEFINITION = {
    True: re.compile(r"(?m)^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?[0-9]+)?[ \t]*:"),
    False: re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)\s*::="),
}
#: Inside a rule: references, items, grouping (Lark's ``[...]`` is an optional group) and counted
#: repetition (Lark's ``~n``, ``~n..m``; both's ``{n}``, ``{n,m}``).
_PART = {
    lark: re.compile(
        rf"({name})|@|([(\[])|([)\]])|~\s*([0-9]+)(?:\s*\.\.\s*([0-9]+))?|\{{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}}"
    )
    for lark, name in ((True, "[A-Za-z_][A-Za-z0-9_]*"), (False, "[A-Za-z_][A-Za-z0-9_-]*"))
}
_NAME = {True: re.compile(r"[A-Za-z_][A-Za-z0-9_]*"), False: re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")}
#: Lark directives whose argument is JSON (``%json`` a schema).
_JSON_DIRECTIVE = re.compile(r"%(json|llguidance|regex)\b\s*(?=\{)")


def grammar_size(text: str, *, lark: bool, data_bytes: int | None = None) -> ConstraintSize:
    """The sizes of a Lark (``lark``) or GBNF grammar: its rules, its alternatives (``|``, and one
    per rule), its depth (each rule one level, each rule it reaches one more, each parenthesis, and
    Lark ``[...]``, around a reference one more; a ``%json`` schema or a regular expression inside
    adds its own) and its largest repetition within one rule or regular expression."""
    size = len(text.encode("utf-8", errors="surrogatepass")) if data_bytes is None else data_bytes
    schemas: list[tuple[int, Shape]] = []  # where each %json schema is, and its shape
    if lark and "%" in text:
        text = _blank_json_arguments(text, schemas)
    text = _COMMENT[lark].sub(r"\1", text)
    inner = [regex_shape(pattern) for pattern in _OPAQUE[lark].findall(text) if pattern]
    text = _OPAQUE[lark].sub("@", text)
    definitions = list(_DEFINITION[lark].finditer(text))
    numbers: dict[str, int] = {}
    for definition in definitions:
        numbers.setdefault(definition.group(1), len(numbers))
    base = [1] * len(numbers)
    children: list[list[int]] = [[] for _ in numbers]
    extra: list[list[int]] = [[] for _ in numbers]
    bars, repetition = 0, max((shape.repetition for shape in inner), default=0)
    for i, definition in enumerate(definitions):
        number = numbers[definition.group(1)]
        end = definitions[i + 1].start() if i + 1 < len(definitions) else len(text)
        body = text[definition.end() : end]
        bars += body.count("|")
        if "(" not in body and "{" not in body and not (lark and ("[" in body or "~" in body)):
            for name in _NAME[lark].findall(body):  # the common case, without a loop per item
                if name in numbers:
                    children[number].append(numbers[name])
                    extra[number].append(0)
            continue
        paren = 0
        counter = _Repetition()
        for name, opened, closed, tilde, tilde_high, low, high in _PART[lark].findall(body):
            if opened:
                paren += 1
                base[number] = max(base[number], paren + 1)
                counter.open()
            elif closed:
                paren = max(0, paren - 1)
                counter.close()
            elif tilde or low:
                counter.repeat(int(tilde or low), tilde_high if tilde else high)
            else:
                counter.item()
                if name in numbers:
                    children[number].append(numbers[name])
                    extra[number].append(paren)
        repetition = max(repetition, counter.largest())
    starts = [definition.start() for definition in definitions]
    for where, shape in schemas:
        holder = bisect_left(starts, where) - 1  # the rule the schema is in
        if holder >= 0:
            number = numbers[definitions[holder].group(1)]
            base[number] = max(base[number], 1 + shape.depth)
        bars += shape.alternatives
        repetition = max(repetition, shape.repetition)
    depth = max([_longest(list(range(len(numbers))), base, children, extra), *(shape.depth for shape in inner)])
    return ConstraintSize(size, depth, len(numbers), bars + len(numbers), repetition)


def _blank_json_arguments(text: str, schemas: list[tuple[int, Shape]]) -> str:
    """``text`` with the JSON argument of each ``%json``, ``%llguidance`` and ``%regex`` blanked
    (its strings would read as grammar), each ``%json`` schema's shape added to ``schemas``."""
    decoder = json.JSONDecoder()
    pieces, pos = [], 0
    for match in _JSON_DIRECTIVE.finditer(text):
        if match.start() < pos:
            continue
        try:
            value, end = decoder.raw_decode(text, match.end())
        except ValueError:
            continue
        if match.group(1) == "json":
            schemas.append((match.start(), schema_shape(value)))
        pieces += [text[pos : match.start()], " " * (end - match.start())]
        pos = end
    return "".join([*pieces, text[pos:]])


def _what(constraint: Constraint) -> str:
    return KIND_NAMES.get(constraint.kind, f"{constraint.kind} constraint")


def _too_deep(constraint: Constraint, depth: int | None, limit: int | None) -> RequestError:
    limit = CEILINGS.max_depth if limit is None else limit
    levels = f"{depth:,} levels" if depth is not None else "too deep"
    following = " (following its $refs)" if constraint.kind == "json_schema" else ""
    return RequestError(
        f"this {_what(constraint)} nests {levels}{following}, more than {_WHERE}.max_depth ({limit:,})",
        field=constraint.field,
    )
