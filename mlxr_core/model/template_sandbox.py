"""The sandbox a chat template renders in: Jinja2's immutable sandbox, with every operation bounded.

Jinja's sandbox bounds what a template may reach, not how much work it may do: a chain of filters
over 16M items, ``'x'|center(10**9)`` or ``lipsum(n=10**6)`` runs inside one filter or one C call,
far from any loop, for minutes. Here each operation counts:

- time: every loop step, call, filter and test checks the render's budget
  (:mod:`mlxr_core.model.template_budget`), and so does every item a filter takes from a sequence;
- size: a string stays within :data:`MAX_STRING` characters and a list within :data:`MAX_ITEMS`
  items, checked *before* the work wherever the work is a single C call (repetition, padding,
  ``%`` and ``format`` widths, ``replace``, ``join``, ``expandtabs``);
- weight: a literal, a repetition, a concatenation, a call or a filter cannot make a value whose
  text (what printing, joining, comparing or hashing it walks) would pass :data:`MAX_STRING`
  characters, however it shares references: ``[x, x]`` nested 64 times is 64 lists, but 2**64
  copies of ``x`` once printed (:func:`weigh`).
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView
from types import BuiltinMethodType, MethodType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Cycler, Namespace, generate_lorem_ipsum

from mlxr_core.model.template_budget import check_budget, current_budget

#: The longest string a template may build, in characters; also what a value's text may weigh.
MAX_STRING = 1 << 24
#: The most characters a render's ``{{ }}`` may write in all: into its output, and into the blocks,
#: macros and ``{% set %}`` bodies it builds (a loop in a macro holds every piece until it ends).
MAX_WRITTEN = 2 * MAX_STRING
#: The most items a list a template builds may hold, or a filter may take from a sequence.
MAX_ITEMS = 1 << 20
#: The longest text for filters that spend Python work on every character (``wordwrap``,
#: ``urlize``, ``pprint``).
MAX_TEXT_WORK = 1 << 18
#: The most words ``lipsum`` may write.
MAX_LIPSUM_WORDS = 1 << 16
#: The widest ``indent`` or ``separators`` that ``tojson`` takes.
MAX_JSON_INDENT = 64
#: The largest exponent a template may use with ``**``.
MAX_EXPONENT = 4096
#: The largest integer (in bits) a template may compute with ``**``: ``(10 ** 4000) ** 4000``
#: keeps each exponent small but would cost seconds of CPU.
MAX_POWER_BITS = 1 << 16


class TooLarge(SecurityError):
    """A template operation that would build a value past a size limit; the message says which."""


def bounded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``, refused past :data:`MAX_ITEMS` items, checking the budget every 64 (each item's
    own work, a filter applied to it, checks it too)."""
    for count, item in enumerate(iterable, 1):
        if not count & 63:
            check_budget()
            if count > MAX_ITEMS:
                raise TooLarge(f"a sequence whose length is past the limit of {MAX_ITEMS}")
        yield item


def require(size: int, limit: int, what: str) -> None:
    """Refuse an operation whose ``what`` (a width, a length ...) has a ``size`` past ``limit``."""
    if size > limit:
        raise TooLarge(f"{what} {size} is past the limit of {limit}")


# -- weight: the text a value stands for ------------------------------------------------------


def weigh(value: Any) -> int:
    """About how many characters ``str(value)`` holds: strings their length, containers their
    items' weights (each distinct container walked once, so shared references cost nothing to
    weigh). Raises :class:`TooLarge` as soon as it passes :data:`MAX_STRING`."""
    if isinstance(value, (str, bytes)):
        size = len(value)
    elif value is None or isinstance(value, (bool, int, float)):
        return _scalar_weight(value)
    else:
        size = _Scale().weigh(value)
    require(size, MAX_STRING, "a value with a text length of")
    return size


def weighed(value: Any) -> Any:
    """``value``, once :func:`weigh` has let it pass."""
    weigh(value)
    return value


def written(value: Any) -> Any:
    """``value``, which a ``{{ }}`` is about to write: weighed, and counted against :data:`MAX_WRITTEN`."""
    size = weigh(value)
    budget = current_budget()
    if budget is not None:
        budget.written += size
        require(budget.written, MAX_WRITTEN, "the text its {{ }} have written, of length")
    return value


def _scalar_weight(value: Any) -> int:
    return value.bit_length() // 3 + 2 if isinstance(value, int) else 24


class _Scale:
    def __init__(self) -> None:
        self.known: dict[int, int] = {}
        self.steps = 0

    def weigh(self, value: Any) -> int:
        if isinstance(value, (str, bytes)):
            return len(value) + 2
        if value is None or isinstance(value, (bool, int, float)):
            return _scalar_weight(value)
        known = self.known.get(id(value))
        if known is not None:
            return known
        items = _parts(value)
        if items is None:
            return 32  # an object whose text is a short fixed repr (a macro, a loop, a range)
        self.steps += 1
        if not self.steps % 1024:
            check_budget()
        total = 2
        for item in items:
            kind = type(item)  # strings and numbers inline: a list of a million costs 0.1 s, not 1 s
            if kind is str:
                total += len(item) + 4
            elif kind is int:
                total += item.bit_length() // 3 + 4
            elif kind is float or item is None or kind is bool:
                total += 26
            else:
                total += self.weigh(item) + 2
            if total > MAX_STRING:
                raise TooLarge(f"a value with a text length past the limit of {MAX_STRING}")
        self.known[id(value)] = total
        return total


def _parts(value: Any) -> Iterable[Any] | None:
    """What ``str(value)`` writes out of ``value``, for a container; None for anything else."""
    if isinstance(value, Mapping):
        return (part for pair in value.items() for part in pair)
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, Namespace):
        return _parts(value._Namespace__attrs)  # type: ignore[attr-defined]
    if isinstance(value, Cycler):
        return value.items
    if isinstance(value, MappingView):
        return value  # type: ignore[return-value]
    return None


def made(value: Any) -> Any:
    """``value`` (what a call or a filter returned), refused past the size and weight limits."""
    if isinstance(value, str):
        require(len(value), MAX_STRING, "a string of length")
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        require(len(value), MAX_ITEMS, "a sequence of length")
        weigh(value)
    elif isinstance(value, (Namespace, Cycler)):
        weigh(value)
    return value


# -- formatting: what % and str.format would write ---------------------------------------------

_PRINTF = re.compile(r"%(\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 10 else 10**10


def printf_size(fmt: str, args: Any) -> int:
    """An upper bound of ``len(fmt % args)``: the format, its widths and precisions, and the text
    of each value it writes (each of them, for named fields, which may repeat)."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    weights = [weigh(value) for value in values]
    star = max((abs(value) for value in values if isinstance(value, int)), default=0)
    size, fields, named = len(fmt), 0, False
    for match in _PRINTF.finditer(fmt):
        if match[4] == "%":
            continue
        fields += 1
        named = named or match[1] is not None
        for part in (match[2], match[3]):
            size += star if part == "*" else _number(part) if part else 0
    return size + (fields * max(weights, default=0) if named else sum(weights))


def format_size(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """An upper bound of ``len(fmt.format(*args, **kwargs))``, as :func:`printf_size`."""
    values = [*args, *kwargs.values()]
    weights = [weigh(value) for value in values]
    star = max((abs(value) for value in values if isinstance(value, int)), default=0)
    size, fields, numbered = len(fmt), 0, False
    for _, name, spec, _ in string.Formatter().parse(fmt):
        if name is None:
            continue
        fields += 1
        numbered = numbered or name != ""
        size += sum(_number(digits) for digits in re.findall(r"\d+", spec or ""))
        size += star if spec and "{" in spec else 0
    return size + (fields * max(weights, default=0) if numbered else sum(weights))


def replaced_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    """An upper bound of ``len(text.replace(old, new, count))``."""
    kind = str if isinstance(text, str) else bytes  # Markup is a str too
    if not all(isinstance(part, kind) for part in (text, old, new)):
        return weigh(text)
    if len(new) <= len(old):
        return len(text)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


# -- str and bytes methods ---------------------------------------------------------------------

#: What ``split()`` and ``splitlines()`` split at, near enough to bound how many parts they make.
_SPACES = {str: tuple(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"), bytes: tuple(b" \t\n\r\x0b\x0c")}


def _text_method_args(text: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse a call of ``text.name(*args, **kwargs)`` whose result would be too long; returns the
    arguments to call it with (``join``'s items taken once, bounded)."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        require(args[0], MAX_STRING, f"{name}() to a width of")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        tabs = text.count("\t" if isinstance(text, str) else b"\t")
        if isinstance(tabsize, int):
            require(len(text) + tabs * tabsize, MAX_STRING, "expandtabs() to a length of")
    elif name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count")
        require(replaced_size(text, args[0], args[1], count), MAX_STRING, "replace() to a length of")
    elif name == "join" and args:
        items = list(bounded_iter(args[0]))
        size = sum(len(item) for item in items if isinstance(item, (str, bytes)))
        require(size + len(text) * max(len(items) - 1, 0), MAX_STRING, "join() to a length of")
        return (items, *args[1:])
    elif name in ("split", "rsplit", "splitlines"):
        separator = args[0] if args and name != "splitlines" else kwargs.get("sep")
        parts = text.count(separator) if separator else sum(map(text.count, _SPACES[bytes if isinstance(text, bytes) else str]))
        require(parts + 1, MAX_ITEMS, f"{name}() into a number of parts of")
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((weigh(value) for value in args[0].values()), default=1)
        require(len(text) * max(longest, 1), MAX_STRING, "translate() to a length of")
    return args


# -- filters, tests and globals ----------------------------------------------------------------

#: Filters that take their value's items one by one: each item checks the budget and counts.
_ITERATING = frozenset({
    "batch", "groupby", "join", "list", "map", "max", "min", "reject", "rejectattr", "select",
    "selectattr", "slice", "sort", "sum", "unique",
})
#: Filters that compare or write out their items: their value is taken whole, then weighed.
_WHOLE = frozenset({"groupby", "join", "max", "min", "sort", "unique"})
#: Filters that turn their value and arguments into text, or compare them: each is weighed.
_WEIGHING = _WHOLE | frozenset({
    "capitalize", "center", "dictsort", "e", "escape", "forceescape", "format", "indent", "lower",
    "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim", "truncate",
    "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr",
})
#: Tests that compare their value with another.
_COMPARING = frozenset({
    "!=", "<", "<=", "==", ">", ">=", "eq", "equalto", "ge", "greaterthan", "gt", "in", "le",
    "lessthan", "lt", "ne",
})


def _fill(count: Any, fill_with: Any, name: str) -> None:
    if fill_with is not None and isinstance(count, int):
        require(count, MAX_ITEMS, f"{name}() with a slot count of")
        require(count * weigh(fill_with), MAX_STRING, f"{name}() filling a text length of")


def _indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> None:
    text = str(s)
    pad = width if isinstance(width, int) else len(str(width))
    require(len(text) + (text.count("\n") + 1) * max(pad, 0), MAX_STRING, "indent() to a length of")


def _wordwrap(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None,
              break_on_hyphens: bool = True) -> None:  # fmt: skip
    text = str(s)
    require(len(text), MAX_TEXT_WORK, "wordwrap() of a text of length")
    require(len(text) * (1 + len(str(wrapstring or "\n"))), MAX_STRING, "wordwrap() to a length of")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> None:  # fmt: skip
    if indent is not None:
        require(indent if isinstance(indent, int) else len(str(indent)), MAX_JSON_INDENT, "tojson() with an indent of")
    if separators is not None:
        require(sum(len(str(part)) for part in separators), MAX_JSON_INDENT, "tojson() with separators of length")


def _join(value: list[Any], d: Any = "", attribute: Any = None) -> None:
    require(weigh(value) + len(str(d)) * max(len(value) - 1, 0), MAX_STRING, "join() to a length of")


#: Checks of a filter's arguments before it runs, raising :class:`TooLarge`; called with the
#: filter's arguments after the context or environment.
_BEFORE: dict[str, Callable[..., None]] = {
    "batch": lambda value, linecount, fill_with=None: _fill(linecount, fill_with, "batch"),
    "slice": lambda value, slices, fill_with=None: _fill(slices, fill_with, "slice"),
    "center": lambda value, width=80: require(width if isinstance(width, int) else 0, MAX_STRING, "center() to a width of"),
    "indent": _indent,
    "wordwrap": _wordwrap,
    "replace": lambda s, old, new, count=None: require(
        replaced_size(str(s), old, new, count), MAX_STRING, "replace() to a length of"
    ),
    "format": lambda value, *args, **kwargs: require(
        printf_size(str(value), kwargs or args), MAX_STRING, "format() to a length of"
    ),
    "tojson": _tojson,
    "join": _join,
    "pprint": lambda value: require(weigh(value), MAX_TEXT_WORK, "pprint() of a text of length"),
    "urlize": lambda value, *args, **kwargs: require(weigh(value), MAX_TEXT_WORK, "urlize() of a text of length"),
}


def bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, the filter ``name``, taking its items through :func:`bounded_iter`, its
    arguments checked (weighed, :data:`_BEFORE`) and its result through :func:`made`."""
    skip = 0 if getattr(function, "jinja_pass_arg", None) is None else 1
    iterating, whole, weighing = name in _ITERATING, name in _WHOLE, name in _WEIGHING
    before = _BEFORE.get(name)

    @functools.wraps(function)  # keeps jinja_pass_arg: the context or environment still comes first
    def bounded(*args: Any, **kwargs: Any) -> Any:
        check_budget()
        if iterating and len(args) > skip:
            items = bounded_iter(args[skip])
            args = (*args[:skip], list(items) if whole else items, *args[skip + 1:])
        if weighing:
            for value in (*args[skip:], *kwargs.values()):
                weigh(value)
        if before is not None:
            before(*args[skip:], **kwargs)
        result = function(*args, **kwargs)
        if isinstance(result, Iterator):
            return bounded_iter(result)
        return made(result)

    return bounded


def bounded_test(name: str, function: Any) -> Callable[..., Any]:
    """``function``, the test ``name``, checking the budget, and weighing what it compares."""
    comparing = name in _COMPARING

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        check_budget()
        if comparing and args:
            weigh(args[0])
        return function(*args, **kwargs)

    return bounded


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's ``lipsum``, refused past :data:`MAX_LIPSUM_WORDS` words."""
    require(n * max, MAX_LIPSUM_WORDS, "lipsum() with a word count of")
    return generate_lorem_ipsum(n, html, min, max)


# -- the environment ---------------------------------------------------------------------------


class BoundedCode(CodeGenerator):
    """Compiles a template so each value it builds or compares is weighed: ``~`` through
    :meth:`BoundedEnvironment.concat_parts`, literals and comparison operands through
    :func:`weighed`."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_parts((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._weighed(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._weighed(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":
            self._weighed(super().visit_Tuple, node, frame)
        else:  # an assignment target: (a, b) = ...
            super().visit_Tuple(node, frame)

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
        # Comparing (or hashing, for `in`) walks as much as printing would.
        self.write("(")
        self._weighed(self.visit, node.expr, frame)
        for operand in node.ops:
            self.visit(operand, frame)
        self.write(")")

    def _weighed(self, visit: Callable[[Any, Frame], None], node: nodes.Node, frame: Frame) -> None:
        self.write("environment.weighed(")
        visit(node, frame)
        self.write(")")


def _bounded_join(parts: Iterable[str]) -> str:
    """``"".join(parts)`` for a block, a macro or a ``{% set %}`` body, refused past :data:`MAX_STRING`."""
    parts = parts if isinstance(parts, list) else list(parts)
    require(sum(map(len, parts)), MAX_STRING, "a block rendering a length of")
    return "".join(parts)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operation bounded in time and size (see the module)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = BoundedCode
    concat = staticmethod(_bounded_join)  # type: ignore[assignment]
    weighed = staticmethod(weighed)

    def __init__(self, **options: Any):
        super().__init__(finalize=written, **options)
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: bounded_test(name, test) for name, test in self.tests.items()}
        self.globals["lipsum"] = lipsum

    def add_filter(self, name: str, function: Callable[..., Any]) -> None:
        """Install ``function`` as the filter ``name``, bounded like Jinja's own."""
        self.filters[name] = bounded_filter(name, function)

    @staticmethod
    def concat_parts(parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ ...``: each part weighed before it is turned into text."""
        require(sum(weigh(part) for part in parts), MAX_STRING, "a ~ concatenation of length")
        return "".join(map(str, parts))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        check_budget()  # macros calling macros loop without a {% for %}
        if isinstance(getattr(__obj, "__self__", None), (str, bytes)):  # Markup's methods too
            args = _text_method_args(__obj.__self__, __obj.__name__, args, kwargs)
        if isinstance(__obj, (BuiltinMethodType, MethodType)):
            for value in (*args, *kwargs.values()):  # a method may hash or compare them
                weigh(value)
        return made(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(sandboxed)
        def bounded(*args: Any, **kwargs: Any) -> str:
            check_budget()
            mapping = args[0] if is_map and len(args) == 1 and isinstance(args[0], Mapping) else None
            size = format_size(fmt, (), mapping) if mapping is not None else format_size(fmt, args, kwargs)
            require(size, MAX_STRING, "format() to a length of")
            return sandboxed(*args, **kwargs)

        return bounded

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_budget()
        if operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                require(len(left) + len(right), MAX_STRING, "a + concatenation of length")
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                require(len(left) + len(right), MAX_ITEMS, "a + concatenation of length")
                require(weigh(left) + weigh(right), MAX_STRING, "a + concatenation with a text length of")
        elif operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(count, int) and count > 0:
                    limit = MAX_STRING if isinstance(sequence, (str, bytes)) else MAX_ITEMS
                    require(len(sequence) * count, limit, "a repetition of length")
                    require(weigh(sequence) * count, MAX_STRING, "a repetition with a text length of")
        elif operator == "%":
            if isinstance(left, (str, bytes)):
                text = left if isinstance(left, str) else left.decode("latin-1")
                require(printf_size(text, right), MAX_STRING, "a % format to a length of")
        elif isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"an exponent above {MAX_EXPONENT}")
        elif isinstance(left, int) and isinstance(right, int) and left.bit_length() * abs(right) > MAX_POWER_BITS:
            raise SecurityError(f"a power larger than {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)
