"""How likely a model is to answer with each of a few given options (``/v1/decisions``): each
option scored by all of its tokens, as the answer is decoded under a choice constraint.

An answer constrained to options ``o`` is written a token at a time, each drawn from the model's
next-token distribution restricted to the tokens that keep it on some option (and to the end of
the answer once it has spelled one out). An option's probability is the product of those
restricted probabilities along its tokens, the end included where another option goes on from it:

    P(o) = prod_i p(o_i | x, o_<i) / sum_{a allowed after o_<i} p(a | x, o_<i)   [ * end term ]

so ``1`` and ``10`` on a tokenizer that writes ``10`` as ``1``, ``0`` are told apart by the
model's choice between ``0`` and the end after ``1`` (scoring their first token alone gives them
one probability, shared). Options whose first tokens differ get their first tokens' probabilities,
normalized over the options. The probabilities over the options add up to 1.

Runs on the engine thread as a job (:class:`OptionScoringWork`): the prompts' shared prefix is
taken from the engine's prefix cache as far as an entry holds it (a request that prefilled it
before) and prefilled once past that; the prompts' rests then run as rows of one forward pass
(up to :data:`MAX_ROWS` at a time, right-padded, where the model's caches are plain attention
caches; else one by one) from copies of it, and each option's tokens from a copy of its own row's
cache, only where a branch point needs the model's distribution. The result counts the tokens
each phase ran (:class:`OptionScores`). Under a LoRA adapter (one served as a model of its own)
every forward pass runs with it, one prompt at a time, as the rows of a request to it do; the job
holds its slot until it ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

from mlxr_core.model.cache import plain_attention

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

#: The end of an answer, among the tokens a branch point allows.
END = -1

#: Prompts whose rests one forward pass runs together.
MAX_ROWS = 32
#: Positions (the shared prefix's copy and the rest, per row) the rows of one pass hold together:
#: each row's cache holds its own copy of the prefix.
MAX_ROW_POSITIONS = 8192


def allowed_tokens(options: Sequence[Sequence[int]]) -> dict[tuple[int, ...], set[int]]:
    """For each prefix of an option's tokens, the tokens that keep an answer on some option after
    it (:data:`END` where an option ends there)."""
    allowed: dict[tuple[int, ...], set[int]] = {}
    for ids in options:
        for i in range(len(ids) + 1):
            allowed.setdefault(tuple(ids[:i]), set()).add(ids[i] if i < len(ids) else END)
    return allowed


def option_logprobs(options: Sequence[Sequence[int]], logprobs: Mapping[tuple[int, ...], Mapping[int, float]]) -> list[float]:
    """Each option's log-probability under the choice constraint, from ``logprobs``: per branch
    point (a prefix allowing two or more tokens), the model's log-probability of each allowed
    token there (:data:`END`: of ending the answer)."""
    allowed = allowed_tokens(options)
    scores = []
    for ids in options:
        total = 0.0
        for i in range(len(ids) + 1):
            prefix = tuple(ids[:i])
            if len(allowed[prefix]) < 2:
                continue
            here = logprobs[prefix]
            chosen = ids[i] if i < len(ids) else END
            total += here[chosen] - _logsumexp([here[token] for token in allowed[prefix]])
        scores.append(total)
    return scores


def probabilities(logprobs: Sequence[float]) -> list[float]:
    """Log-probabilities as probabilities that add up to 1 (a uniform split if none is finite)."""
    top = max(logprobs)
    if top == -math.inf:
        return [1.0 / len(logprobs)] * len(logprobs)
    weights = [math.exp(value - top) for value in logprobs]
    total = sum(weights)
    return [weight / total for weight in weights]


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(value - top) for value in values))


@attrs.frozen
class OptionScores:
    """Per prompt, its options' log-probabilities; and the positions the job computed: the shared
    prefix's taken from the prefix cache (``reused``), prefilled (``prefilled``: the shared prefix
    past that once, then each prompt's rest) and run at branch points (``branched``)."""

    scores: list[list[float]]
    reused: int
    prefilled: int
    branched: int


@attrs.frozen
class OptionScoringWork:
    """A job's work (:class:`~mlxr_core.engine.jobs.EngineJob`): per prompt, its options'
    log-probabilities (:func:`option_logprobs`). A value, so an engine in another process can be
    sent it. ``end`` holds the ids that end an answer (the tokenizer's end-of-sequence ids);
    ``adapter`` the model's LoRA adapter every pass runs with, or None."""

    model: str
    prompts: list[list[int]]
    options: list[list[list[int]]]
    end: list[int]
    chunk: int
    adapter: str | None = None

    def __call__(self, models: Mapping[str, LoadedModel]) -> Generator[str | None, None, OptionScores]:
        from mlxr_core.engine.adapters import hold_adapter, release_adapter

        loaded = models[self.model]
        slot = (yield from hold_adapter(loaded, self.adapter)) if self.adapter is not None else 0
        try:
            return (yield from self._run(_Passes(loaded, slot)))
        finally:
            if slot:
                release_adapter(loaded, slot)

    def _run(self, loaded: _Passes) -> Generator[None, None, OptionScores]:
        shared = common_prefix(self.prompts)
        # A prompt that is the shared prefix itself needs the logits at its last position: then
        # that position is run here, not taken from the prefix cache.
        limit = len(shared) - (1 if any(len(prompt) == len(shared) for prompt in self.prompts) else 0)
        reused, cache = loaded.cached_prefix(shared, limit)
        last = yield from _prefill(loaded, cache, shared[reused:], self.chunk)
        base = [layer.snapshot() for layer in cache]
        # Prompts' rests run as rows of one pass where the caches are plain attention caches
        # (right-padded: a row's positions never see the padding after them); else one by one.
        together = not loaded.slot and plain_attention(cache)
        results, prefilled, branched = [], len(shared) - reused, 0
        start = 0
        while start < len(self.prompts):
            yield
            group = self._group(start, len(shared)) if together else [start]
            tails = [self.prompts[i][len(shared) :] for i in group]
            if len(group) > 1:
                firsts, snapshots = _prefill_rows(loaded, base, len(shared), tails)
            else:
                cache = _restored(loaded, base, len(shared))
                first = (yield from _prefill(loaded, cache, tails[0], self.chunk)) if tails[0] else last
                if first is None:
                    raise ValueError("an empty prompt has no answer to score")
                firsts, snapshots = [first], _Snapshots(cache, 0)
            for row, i in enumerate(group):
                scores, ran = self._score(loaded, snapshots.row(row), len(self.prompts[i]), firsts[row], self.options[i])
                results.append(scores)
                branched += ran
            prefilled += sum(map(len, tails))
            start += len(group)
        return OptionScores(results, reused, prefilled, branched)

    def _group(self, start: int, shared: int) -> list[int]:
        """The prompts from ``start`` on whose rests run as rows of one pass: at most
        :data:`MAX_ROWS`, the rows times the longest rest within a prefill chunk and times the
        positions a row holds within :data:`MAX_ROW_POSITIONS`, none empty."""
        group: list[int] = []
        longest = 0
        for i in range(start, min(len(self.prompts), start + MAX_ROWS)):
            rest = len(self.prompts[i]) - shared
            rows, widest = len(group) + 1, max(longest, rest)
            if rest == 0 or (group and (rows * widest > self.chunk or rows * (shared + widest) > MAX_ROW_POSITIONS)):
                break
            group.append(i)
            longest = max(longest, rest)
        return group or [start]

    def _score(
        self, loaded: _Passes, snapshot: Callable[[], list[tuple[mx.array, ...]]], length: int, first: mx.array,
        options: list[list[int]],
    ) -> tuple[list[float], int]:
        allowed = allowed_tokens(options)
        branches = {prefix for prefix, tokens in allowed.items() if len(tokens) > 1}
        logprobs: dict[tuple[int, ...], dict[int, float]] = {}
        if () in branches:
            logprobs[()] = self._pick(first, allowed[()])
        held = snapshot() if len(branches) > len(logprobs) else []
        ran = 0
        for ids in options:
            # The deepest branch point along this option whose distribution is still unknown.
            depth = max((i for i in range(1, len(ids) + 1) if tuple(ids[:i]) in branches), default=0)
            if depth == 0 or all(tuple(ids[:i]) in logprobs for i in range(1, depth + 1) if tuple(ids[:i]) in branches):
                continue
            forked = _restored(loaded, held, length)
            logits = loaded.model(mx.array([ids[:depth]], dtype=mx.int32), cache=forked)[0]
            ran += depth
            for i in range(1, depth + 1):
                prefix = tuple(ids[:i])
                if prefix in branches and prefix not in logprobs:
                    logprobs[prefix] = self._pick(logits[i - 1], allowed[prefix])
        return option_logprobs(options, logprobs), ran

    def _pick(self, logits: mx.array, tokens: set[int]) -> dict[int, float]:
        """The log-probabilities of ``tokens`` (:data:`END`: of any end id) in ``[V]`` logits."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1)
        ids = sorted(token for token in tokens if token != END)
        values = logprobs[mx.array(ids, dtype=mx.int32)].tolist() if ids else []
        picked: dict[int, float] = dict(zip(ids, values, strict=True))  # type: ignore[arg-type]
        if END in tokens:
            end = mx.logsumexp(logprobs[mx.array(self.end, dtype=mx.int32)]).item() if self.end else -math.inf
            picked[END] = float(end)  # type: ignore[arg-type]
        return picked


def common_prefix(rows: list[list[int]]) -> list[int]:
    """The longest list of ids every one of ``rows`` starts with."""
    shortest = min(rows, key=len)
    for i, token in enumerate(shortest):
        if any(row[i] != token for row in rows):
            return shortest[:i]
    return list(shortest)


class _Passes:
    """A loaded model's forward passes for one job, each with adapter ``slot`` (0: none)."""

    def __init__(self, loaded: LoadedModel, slot: int):
        self.loaded, self.slot = loaded, slot

    def make_cache(self) -> list[Any]:
        return self.loaded.make_cache()

    def cached_prefix(self, tokens: list[int], limit: int) -> tuple[int, list[Any]]:
        """How many of ``tokens`` (at most ``limit``) the model's prefix cache holds, and a cache
        restored to them (a fresh one, 0, where it holds none or a pass runs under an adapter,
        whose keys the cache stores apart)."""
        prefix = self.loaded.prefix_cache
        if prefix is not None and not self.slot:
            reused, caches = prefix.lookup(tokens, limit=limit, make_cache=self.loaded.make_cache)
            if caches is not None:
                return reused, caches
        return 0, self.loaded.make_cache()

    def model(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        adapters = self.loaded.adapters
        rows: AbstractContextManager[None] = (
            adapters.rows([self.slot]) if self.slot and adapters is not None else nullcontext()
        )
        with rows:  # the pass is built here: its layers take the slot's updates
            logits: mx.array = self.loaded.model(tokens, cache=cache)
        return logits


class _Snapshots:
    """A cache's snapshot, taken when first asked for, and one row of it (a batch cache's row)."""

    def __init__(self, cache: list[Any], rows: int):
        self.cache, self.rows = cache, rows
        self._held: list[tuple[mx.array, ...]] | None = None

    def row(self, row: int) -> Callable[[], list[tuple[mx.array, ...]]]:
        def snapshot() -> list[tuple[mx.array, ...]]:
            if self._held is None:
                self._held = [layer.snapshot() for layer in self.cache]
            if not self.rows:
                return self._held
            return [tuple(array[row : row + 1] for array in layer) for layer in self._held]

        return snapshot


def _prefill_rows(
    loaded: _Passes, base: list[tuple[mx.array, ...]], length: int, tails: list[list[int]]
) -> tuple[list[mx.array], _Snapshots]:
    """``tails`` (none empty) run as rows of one pass after the first ``length`` positions of
    ``base``, right-padded: each row's ``[V]`` logits at its last token, and the batch cache."""
    rows, longest = len(tails), max(map(len, tails))
    cache = loaded.make_cache()
    if length:
        for layer, arrays in zip(cache, base, strict=True):
            layer.restore(tuple(mx.repeat(array[:, :, :length], rows, axis=0) for array in arrays), length)
    ids = mx.array([tail + [0] * (longest - len(tail)) for tail in tails], dtype=mx.int32)
    logits = loaded.model(ids, cache=cache)
    firsts = logits[mx.arange(rows), mx.array([len(tail) - 1 for tail in tails])]
    mx.eval(firsts, *(array for layer in cache for array in layer.state))
    return [firsts[row] for row in range(rows)], _Snapshots(cache, rows)


def _restored(loaded: _Passes, snapshot: list[tuple[mx.array, ...]], length: int) -> list[Any]:
    """A fresh cache holding the first ``length`` positions of ``snapshot`` (empty for 0)."""
    cache = loaded.make_cache()
    if length == 0:
        return cache
    for layer, arrays in zip(cache, snapshot, strict=True):
        layer.restore(arrays, length)
    return cache


def _prefill(loaded: _Passes, cache: list[Any], tokens: list[int], chunk: int) -> Generator[None, None, mx.array | None]:
    """Run ``tokens`` through ``cache`` a chunk at a time (yielding between chunks); the last
    position's ``[V]`` logits, None for no tokens."""
    logits = None
    for start in range(0, len(tokens), chunk):
        if start:
            yield
        logits = loaded.model(mx.array([tokens[start : start + chunk]], dtype=mx.int32), cache=cache)[0, -1]
        mx.eval(logits, *(array for layer in cache for array in layer.state))
    return logits
