"""Structured output: a logits processor that keeps a request inside a grammar (llguidance).

A request's :attr:`~mlxr_core.engine.request.SamplingParams.constraint` (JSON mode, a JSON Schema, a
regular expression, a Lark or GBNF grammar, a list of choices) is compiled by llguidance against
the model's vocabulary; each step the matcher's token bitmask masks the disallowed logits to
``-inf`` and every emitted token advances the matcher. Once the grammar is complete only an
end-of-generation token is allowed, so the request ends cleanly with EOS. A request that reaches
``max_tokens`` first ends with reason ``"length"`` and its output is a truncated prefix of a valid
document.

JSON schemas compile strictly: a keyword llguidance does not implement (``uniqueItems``, ``if``,
``dependentRequired``, an unknown ``format`` ...) is a :class:`~mlxr_core.errors.RequestError`,
never silently ignored. JSON is generated compact (no whitespace between tokens); a schema's own
``x-guidance`` options may ask for other separators or whitespace. Every refusal names the
constraint's :attr:`~mlxr_core.engine.request.Constraint.field`.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import Constraint, SamplingParams
from mlxr_core.errors import MissingDependency, RequestError

log = logging.getLogger(__name__)

#: The constraint kinds this plugin enforces (its registry meta ``constraints``).
KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf", "choice")
#: How a refusal names a constraint of each kind (a kind not listed: by its name).
_KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON schema", "gbnf": "grammar"}
#: Compiled grammars kept per tokenizer (least recently used dropped first).
CACHE_SIZE = 64

# Defaults for every JSON schema (a schema's ``x-guidance`` may change them) and what no schema
# may change: ``lenient`` would ignore the keywords llguidance does not implement.
_JSON_DEFAULTS = {"whitespace_flexible": False}
_JSON_OVERRIDES = {"lenient": False}

_lock = threading.Lock()
_vocabularies: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependency("llguidance", "structured output (response_format, grammars, format)") from None
    return llguidance


class _Encoder:
    """The tokenizer as llguidance calls it (to tokenize grammar literals): bytes -> ids."""

    def __init__(self, tokenizer: Any, pieces: list[bytes], special: frozenset[int]):
        self._tokenizer = tokenizer
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = pieces
        self.special_token_ids = sorted(special)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids


class Vocabulary:
    """A model's vocabulary as llguidance sees it, and the grammars compiled against it."""

    def __init__(self, tokenizer: Any):
        llguidance = _llguidance()
        vocab = tokenizer.token_bytes()
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        if not self.eos_ids:
            raise RequestError(
                "structured output needs a model with an end-of-generation token; this one has none"
            )
        encoder = _Encoder(tokenizer, list(vocab.pieces), vocab.special)
        self.ll_tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(encoder), eos_token=self.eos_ids
        )
        self.size = len(vocab.pieces)
        self._matchers: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher at the start of ``constraint``'s grammar; RequestError if it does not
        compile. Compiled grammars are cached; each request gets its own copy."""
        grammar = grammar_text(constraint)
        with self._lock:
            compiled = self._matchers.get(grammar)
            if compiled is not None:
                self._matchers.move_to_end(grammar)
                return compiled.deep_copy()
        llguidance = _llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer
        )
        if is_error:
            raise RequestError(_unsupported(constraint, messages), field=constraint.field)
        compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise RequestError(_unsupported(constraint, [compiled.get_error()]), field=constraint.field)
        with self._lock:
            self._matchers[grammar] = compiled
            while len(self._matchers) > CACHE_SIZE:
                self._matchers.popitem(last=False)
            return compiled.deep_copy()


def vocabulary(tokenizer: Any) -> Vocabulary:
    """The :class:`Vocabulary` of ``tokenizer``, built once per tokenizer."""
    with _lock:
        found = _vocabularies.get(tokenizer)
        if found is None:
            found = _vocabularies[tokenizer] = Vocabulary(tokenizer)
        return found


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (raises RequestError for a malformed one)."""
    Matcher = _llguidance().LLMatcher
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
        raise RequestError(f"invalid JSON schema: {exc}", field=field) from None


def _gbnf_as_lark(grammar: str, field: str | None) -> str:
    """A GBNF grammar in Lark (llguidance's converter); one already in Lark (a ``start`` rule or
    ``%llguidance``, as llama.cpp passes such grammars to llguidance) as it is."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # the converter raises bare Exception, IndexError ... on bad input
        raise RequestError(f"this GBNF grammar does not parse: {exc}", field=field) from None


def _unsupported(constraint: Constraint, messages: list[str]) -> str:
    what = _KIND_NAMES.get(constraint.kind, constraint.kind)
    detail = "; ".join(message.strip() for message in messages) or "rejected"
    return f"this {what} cannot be enforced: {detail}"


class GrammarMask:
    """Masks every token the grammar does not allow next; only EOS once the grammar is done."""

    def __init__(self, matcher: Any, eos_ids: list[int], field: str | None = None):
        self.matcher = matcher
        self.eos_ids = eos_ids
        self.field = field

    def allowed(self, width: int) -> np.ndarray:
        """``[width]`` bools: the tokens the grammar allows next. RequestError when the matcher
        gives up on the grammar itself (too complex to follow, such as a schema that requires
        itself): the request ends with that error, not with text the constraint no longer holds."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            allowed = np.zeros(width, dtype=bool)
            allowed[[i for i in self.eos_ids if i < width]] = True
            return allowed
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            raise self._gave_up()
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if allowed.shape[0] < width:  # embedding rows past the vocabulary: never allowed
            return np.concatenate([allowed, np.zeros(width - allowed.shape[0], dtype=bool)])
        return allowed[:width]

    def __call__(self, logits: mx.array) -> mx.array:
        mask = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def accept(self, token: int) -> None:
        """Advance past ``token``. One the grammar does not allow (handed in against the mask)
        ends the grammar (only EOS follows); an allowed one the matcher then fails on is
        :meth:`_gave_up`."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return
        allowed = self.matcher.validate_tokens([token]) == 1
        if self.matcher.consume_token(token):
            return
        if allowed:
            raise self._gave_up()
        log.warning("token %d does not follow the grammar: %s", token, self.matcher.get_error())

    def _gave_up(self) -> RequestError:
        error = str(self.matcher.get_error()).strip().splitlines()
        return RequestError(
            f"the constraint can no longer be enforced: {error[0] if error else 'matcher error'}",
            field=self.field,
        )


def structured(params: SamplingParams, context: SamplerContext) -> GrammarMask | None:
    """The grammar mask of a request with a ``constraint``; None for free text."""
    if params.constraint is None:
        return None
    vocab = _vocabulary(params.constraint, context)
    return GrammarMask(vocab.matcher(params.constraint), vocab.eos_ids, params.constraint.field)


def _validate_structured(params: SamplingParams, context: SamplerContext) -> None:
    """Compile the request's grammar now, so one that cannot be enforced is a 400 at submit."""
    if params.constraint is not None:
        _vocabulary(params.constraint, context).matcher(params.constraint)


def _vocabulary(constraint: Constraint, context: SamplerContext) -> Vocabulary:
    if context.tokenizer is None:
        raise RequestError("structured output needs the model's tokenizer", field=constraint.field)
    return vocabulary(context.tokenizer)


structured.validate = _validate_structured  # type: ignore[attr-defined]
