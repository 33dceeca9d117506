"""A constraint's llguidance grammar, made where the library cannot take the server down.

:func:`grammar_text` turns a :class:`~mlxr_core.engine.request.Constraint` into the grammar
llguidance compiles (from a JSON schema, a regular expression, choices, Lark, or GBNF through
llguidance's converter). :func:`checked_grammar` does it for a client's constraint: measured first
against the server's :class:`~mlxr_core.config.schema.ConstraintLimits`
(:mod:`mlxr_core.engine.constraint_limits`), then converted and validated in a child process
(:class:`GrammarCheckers`) when asked, because the library recurses once per level of a grammar
(a deep one overflows the stack: SIGSEGV) and the GBNF converter is quadratic in rules. A child that
dies or runs past ``compile_timeout_s`` is replaced, and the request gets a 400. Results are kept
by the constraint's digest, so a repeated constraint costs a hash.

The library's own calls (:func:`on_large_stack`) run on a thread with a 64 MiB stack, the child's
checks on 16 MiB: whatever passed the child has four times the room here, whatever thread (a
platform's 512 KiB default included) asked for it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import attrs

from mlxr_core.config.schema import ConstraintLimits
from mlxr_core.engine.constraint_limits import (
    CEILINGS,
    KIND_NAMES,
    ConstraintSize,
    check_bytes,
    check_size,
    constraint_key,
    encoded,
    measure,
)
from mlxr_core.engine.request import Constraint
from mlxr_core.errors import MissingDependency, Overloaded, RequestError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The constraint kinds this plugin enforces (its registry meta ``constraints``).
KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf", "choice")
#: Stack of the threads that build grammars here, and of the child's checks (a quarter of it).
STACK_BYTES = 64 * 2**20
CHILD_STACK_BYTES = 16 * 2**20
#: Child processes checking constraints at once; more requests wait for one.
CHECKERS = 2
#: The library's fuel for building a grammar's lexer, a quarter of its default: a pattern that
#: needs more (one repeating thousands of items, which the limits should refuse first) fails in
#: tenths of a second rather than holding the engine for ten.
LEXER_FUEL = 250_000
#: Earley items one row of the parser may hold: the library's 2,000 fails a choice of more options
#: (or an object of more than ~500 properties) at its first token; the limits allow 20,000.
ROW_ITEMS = 50_000
#: Seconds a checker process may take to start (import the library) before it is given up.
START_TIMEOUT_S = 60.0
#: Grammars kept by constraint digest (least recently used dropped first), in bytes of text.
CACHE_BYTES = 64 * 2**20

# Defaults for every JSON schema (a schema's ``x-guidance`` may change them) and what no schema
# may change: ``lenient`` would ignore the keywords llguidance does not implement.
_JSON_DEFAULTS = {"whitespace_flexible": False}
_JSON_OVERRIDES = {"lenient": False}


def load_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependency("llguidance", "structured output (response_format, grammars, format)") from None
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (raises RequestError for a malformed one). Unbounded:
    for a client's constraint, :func:`checked_grammar`."""
    Matcher = load_llguidance().LLMatcher
    kind, value, field = constraint.kind, constraint.value, constraint.field
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        schema = value
        if not isinstance(schema, dict | bool):
            raise RequestError("a JSON schema must be a JSON object", field=field)
    elif kind == "choice":
        if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) for v in value):
            raise RequestError("choices must be a non-empty list of strings", field=field)
        # Lark's string literals are JSON's (llguidance's own choice grammar is written so).
        return str(Matcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value)))
    elif kind in ("regex", "lark", "gbnf"):
        if not isinstance(value, str):
            raise RequestError(f"a {kind} constraint must be a string", field=field)
        if kind == "regex":
            return str(Matcher.grammar_from_regex(value))
        return str(Matcher.grammar_from_lark(value if kind == "lark" else _gbnf_as_lark(value, field)))
    else:
        raise RequestError(f"unknown constraint kind {kind!r} (supported: {', '.join(KINDS)})", field=field)
    try:
        return str(
            Matcher.grammar_from_json_schema(
                json.dumps(schema), defaults=_JSON_DEFAULTS, overrides=_JSON_OVERRIDES
            )
        )
    except (ValueError, TypeError) as exc:
        raise RequestError(f"invalid JSON schema: {first_line(str(exc))}", field=field) from None


def _gbnf_as_lark(grammar: str, field: str | None) -> str:
    """A GBNF grammar in Lark (llguidance's converter); one already in Lark (a ``start`` rule or
    ``%llguidance``, as llama.cpp passes such grammars to llguidance) as it is."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except RecursionError:
        raise RequestError("this GBNF grammar nests too deeply", field=field) from None
    except Exception as exc:  # the converter raises bare Exception, IndexError ... on bad input
        raise RequestError(f"this GBNF grammar does not parse: {first_line(str(exc))}", field=field) from None


def parser_limits() -> Any:
    """The library's own bounds on building and running a grammar (:data:`LEXER_FUEL`,
    :data:`ROW_ITEMS`)."""
    return load_llguidance().LLParserLimits(initial_lexer_fuel=LEXER_FUEL, max_items_in_row=ROW_ITEMS)


def first_line(message: str) -> str:
    """A library message's first line (and, after a header ending in ``:``, its ``error:`` line, as
    the regex parser writes them): never a panic's location nor a backtrace."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "rejected"
    if any(line.lower().startswith(("panic", "thread '")) for line in lines):
        return "the grammar library gave up on it (too large or too complex); send a smaller or simpler one"
    if lines[0].endswith(":"):
        detail = next((line for line in lines[1:] if line.startswith("error:")), None)
        if detail is not None:
            return f"{lines[0]} {detail}"
    return lines[0]


def unsupported(constraint: Constraint, messages: list[str]) -> str:
    """The 400's message for a constraint the library refused with ``messages``."""
    detail = "; ".join(first_line(message) for message in messages) or "rejected"
    return f"this {KIND_NAMES.get(constraint.kind, constraint.kind)} cannot be enforced: {detail}"


def on_large_stack(call: Callable[[], T]) -> T:
    """``call()`` on a thread of :data:`STACK_BYTES` (its result, or what it raised): the library
    recurses once per level of a grammar, whatever thread asks."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed back to the caller
            outcome.append((False, exc))

    with _stack_lock:  # the size is the process's, for threads started while it is set
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="mlxr-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


_stack_lock = threading.Lock()


# -- the constraint's grammar, checked --------------------------------------------------------


@attrs.frozen
class _Known:
    size: ConstraintSize
    #: Its grammar once converted and checked; None: measured only.
    grammar: str | None = None
    #: Why it cannot be enforced, when it cannot (the refusal's message).
    error: str | None = None


class _Cache:
    """Constraint digest -> :class:`_Known`, least recently used dropped past :data:`CACHE_BYTES`."""

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, _Known] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> _Known | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: str, known: _Known) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes += _weight(known) - (_weight(old) if old is not None else 0)
            self._items[key] = known
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= _weight(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


def _weight(known: _Known) -> int:
    return 256 + len(known.grammar or "") + len(known.error or "")


_known = _Cache()


def checked_grammar(
    constraint: Constraint, limits: ConstraintLimits | None = None, *, isolate: bool = False
) -> str:
    """The llguidance grammar of a client's ``constraint``, refused with a RequestError naming the
    limit it passes (``limits``; unset: :data:`~mlxr_core.engine.constraint_limits.CEILINGS`)
    before the library sees it. ``isolate``: convert and validate it in a child process
    (:func:`checkers`) unless that was done already."""
    limits = CEILINGS if limits is None else limits
    data = encoded(constraint)
    check_bytes(constraint, data, limits)
    key = constraint_key(constraint, data)
    known = _known.get(key)
    if known is None:
        known = _Known(measure(constraint, data))
        _known.put(key, known)
    check_size(constraint, known.size, limits)
    if known.error is not None:
        raise RequestError(known.error, field=constraint.field)
    if known.grammar is not None:
        return known.grammar
    outcome = checkers().check(constraint, limits.compile_timeout_s) if isolate else None
    if outcome is None:  # in this process (a checker child, if asked for, could not start)
        grammar = on_large_stack(lambda: grammar_text(constraint))
    elif outcome.error is not None:
        if outcome.lasting:
            _known.put(key, attrs.evolve(known, error=outcome.error))
        raise RequestError(outcome.error, field=constraint.field)
    else:
        grammar = outcome.grammar
    _known.put(key, attrs.evolve(known, grammar=grammar))
    return grammar


# -- the child processes ----------------------------------------------------------------------


@attrs.frozen
class Checked:
    """What a child made of a constraint: its grammar, or why it cannot be enforced (``lasting``:
    it would be again, so it is remembered; a timeout is not, the machine may have been busy)."""

    grammar: str = ""
    error: str | None = None
    lasting: bool = True


#: What a child runs: its requests come on stdin, its answers go out on a copy of stdout (stdout
#: itself then points at stderr, so nothing the library prints can garble them).
CHILD = "import sys; from mlxr_plugins.samplers.grammars import child_main; child_main(int(sys.argv[1]))"


class GrammarChecker:
    """One child process that converts and validates constraints, one at a time; started on first
    use and again after it died or was killed."""

    def __init__(self, stack_bytes: int = CHILD_STACK_BYTES):
        self.stack_bytes = stack_bytes
        self._process: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None

    def check(self, constraint: Constraint, timeout: float) -> Checked | None:
        """Convert and validate ``constraint`` in the child, within ``timeout`` seconds (its start
        not counted); None when no child could start."""
        what = KIND_NAMES.get(constraint.kind, constraint.kind)
        if not self._start():
            return None
        assert self._send is not None and self._receive is not None
        try:
            self._send.send((constraint.kind, constraint.value))
            if not self._receive.poll(timeout):
                self.stop()
                log.warning(
                    "a %s (%s) took longer than %g s to check; its checker was killed",
                    what, constraint.field, timeout,
                )  # fmt: skip
                return Checked(
                    error=f"this {what} took longer than {timeout:g} s to compile "
                    "(engine.constraint_limits.compile_timeout_s); send a smaller or simpler one",
                    lasting=False,
                )
            answer, text = self._receive.recv()
        except (EOFError, OSError):
            code = self.stop()
            reason = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
            log.warning(
                "the grammar checker died (%s) on a %s of %d bytes (%s); the request gets a 400",
                reason, what, len(encoded(constraint)), constraint.field,
            )  # fmt: skip
            return Checked(
                error=f"this {what} cannot be enforced: the grammar library failed on it; "
                "send a smaller or simpler one"
            )
        if answer == "ok":
            return Checked(grammar=text)
        return Checked(error=text if answer == "refused" else unsupported(constraint, [text]))

    def _start(self) -> bool:
        """A child running and ready (started now if need be); False, logged, if none starts."""
        if self._process is not None and self._process.poll() is None:
            return True
        self.stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(self.stack_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        except OSError as exc:
            log.warning("no grammar checker process could start (%s); checking in this process", exc)
            return False
        assert process.stdin is not None and process.stdout is not None
        self._send = Connection(os.dup(process.stdin.fileno()), readable=False)
        self._receive = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        self._process = process
        try:
            ready = self._receive.poll(START_TIMEOUT_S) and self._receive.recv() == ("ready", "")
        except (EOFError, OSError):
            ready = False
        if not ready:
            log.warning("the grammar checker process did not start; checking in this process")
            self.stop()
        return ready

    def stop(self) -> int | None:
        """End the child (killed if it still runs); its exit status, None if none ran."""
        process, self._process = self._process, None
        for connection in (self._send, self._receive):
            if connection is not None:
                connection.close()
        self._send = self._receive = None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        return process.wait()


class GrammarCheckers:
    """A few :class:`GrammarChecker` shared by every request: a new constraint waits for a free one
    (up to its timeout, then :class:`~mlxr_core.errors.Overloaded`)."""

    def __init__(self, processes: int = CHECKERS, stack_bytes: int = CHILD_STACK_BYTES):
        self._all = [GrammarChecker(stack_bytes) for _ in range(processes)]
        self._idle: queue.LifoQueue[GrammarChecker] = queue.LifoQueue()  # the warm one first
        for checker in self._all:
            self._idle.put(checker)

    def check(self, constraint: Constraint, timeout: float) -> Checked | None:
        """:meth:`GrammarChecker.check` on the first checker free."""
        try:
            checker = self._idle.get(timeout=timeout)
        except queue.Empty:
            raise Overloaded(
                f"every grammar checker has been busy for {timeout:g} s; retry later"
            ) from None
        try:
            return checker.check(constraint, timeout)
        finally:
            self._idle.put(checker)

    def close(self) -> None:
        for checker in self._all:
            checker.stop()


_checkers: GrammarCheckers | None = None
_checkers_lock = threading.Lock()


def checkers() -> GrammarCheckers:
    """The process's :class:`GrammarCheckers`, made on first use (their children then too)."""
    global _checkers
    with _checkers_lock:
        if _checkers is None:
            _checkers = GrammarCheckers()
            atexit.register(_checkers.close)
        return _checkers


def child_main(stack_bytes: int = CHILD_STACK_BYTES) -> None:
    """A checker child's loop: ``(kind, value)`` in, ``("ok", grammar)``, ``("refused", message)``
    (a malformed constraint) or ``("error", library message)`` out, until stdin closes."""
    answers = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    requests = Connection(os.dup(0), writable=False)
    load_llguidance()
    answers.send(("ready", ""))
    threading.stack_size(stack_bytes)
    thread = threading.Thread(target=_serve, args=(requests, answers), name="mlxr-grammar-check")
    thread.start()
    thread.join()


def _serve(requests: Connection, answers: Connection) -> None:
    while True:
        try:
            kind, value = requests.recv()
        except EOFError:
            return
        try:
            grammar = grammar_text(Constraint(kind, value))
            is_error, messages = load_llguidance().LLMatcher.validate_grammar_with_warnings(
                grammar, limits=parser_limits()
            )
            answer = ("error", messages[0] if messages else "rejected") if is_error else ("ok", grammar)
        except RequestError as exc:
            answer = ("refused", str(exc))
        except Exception as exc:  # the library's own failures: the request's 400
            answer = ("error", str(exc))
        answers.send(answer)
