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

A client's constraint is measured against ``engine.constraint_limits`` and checked in a child
process at submit (:mod:`mlxr_plugins.samplers.grammars`) before this process compiles it: a
grammar too deep or too large for the library is a 400, never a crash.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from mlxr_core.config.schema import ConstraintLimits
from mlxr_core.engine.decoding import SamplerContext
from mlxr_core.engine.request import Constraint, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_plugins.samplers.grammars import (
    KINDS,
    checked_grammar,
    first_line,
    grammar_text,
    load_llguidance,
    on_large_stack,
    parser_limits,
    unsupported,
)

__all__ = ["KINDS", "GrammarMask", "Vocabulary", "grammar_text", "structured", "vocabulary"]

log = logging.getLogger(__name__)

#: Compiled grammars kept per tokenizer (least recently used dropped first).
CACHE_SIZE = 64

_lock = threading.Lock()
_vocabularies: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()


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
        llguidance = load_llguidance()
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

    def matcher(
        self, constraint: Constraint, limits: ConstraintLimits | None = None, *, isolate: bool = False
    ) -> Any:
        """A fresh matcher at the start of ``constraint``'s grammar; RequestError if it passes
        ``limits`` or does not compile (:func:`~mlxr_plugins.samplers.grammars.checked_grammar`,
        ``isolate``: checked in a child process first). Compiled grammars are cached; each request
        gets its own copy."""
        grammar = checked_grammar(constraint, limits, isolate=isolate)
        with self._lock:
            compiled = self._matchers.get(grammar)
            if compiled is not None:
                self._matchers.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = on_large_stack(lambda: self._compile(grammar))
        if compiled.is_error():
            raise RequestError(unsupported(constraint, [compiled.get_error()]), field=constraint.field)
        with self._lock:
            self._matchers[grammar] = compiled
            while len(self._matchers) > CACHE_SIZE:
                self._matchers.popitem(last=False)
            return compiled.deep_copy()

    def _compile(self, grammar: str) -> Any:
        """A matcher of ``grammar``, its first mask computed: the lexer is built lazily, so a grammar
        too costly for it fails here, at submit, not in the engine's first step."""
        matcher = load_llguidance().LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        return matcher


def vocabulary(tokenizer: Any) -> Vocabulary:
    """The :class:`Vocabulary` of ``tokenizer``, built once per tokenizer."""
    with _lock:
        found = _vocabularies.get(tokenizer)
        if found is None:
            found = _vocabularies[tokenizer] = Vocabulary(tokenizer)
        return found


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

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar allows next in turn (the matcher
        is not advanced): a draft is cut at the first one it does not allow."""
        if not tokens or self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens(tokens))

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
        return RequestError(
            f"the constraint can no longer be enforced: {first_line(str(self.matcher.get_error()))}",
            field=self.field,
        )


def structured(params: SamplingParams, context: SamplerContext) -> GrammarMask | None:
    """The grammar mask of a request with a ``constraint``; None for free text."""
    if params.constraint is None:
        return None
    vocab = _vocabulary(params.constraint, context)
    return GrammarMask(vocab.matcher(params.constraint), vocab.eos_ids, params.constraint.field)


def _validate_structured(params: SamplingParams, context: SamplerContext) -> None:
    """Measure the request's constraint against the server's limits, check it in a child process
    and compile it now, so one that cannot be enforced is a 400 at submit and never reaches the
    engine."""
    if params.constraint is not None:
        vocab = _vocabulary(params.constraint, context)
        limits = context.constraint_limits or ConstraintLimits()
        vocab.matcher(params.constraint, limits, isolate=True)


def _vocabulary(constraint: Constraint, context: SamplerContext) -> Vocabulary:
    if context.tokenizer is None:
        raise RequestError("structured output needs the model's tokenizer", field=constraint.field)
    return vocabulary(context.tokenizer)


structured.validate = _validate_structured  # type: ignore[attr-defined]
