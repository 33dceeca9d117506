"""Reuse of prompt cache state across requests that share a token prefix.

After a prompt is prefilled, each layer's cache snapshot (keys and values; a recurrent layer's
state at the prompt's end) is stored under its token ids. A new request takes the entry with the
longest common prefix (a system prompt, the earlier turns of a conversation, the same document)
and prefills only the rest. Keys and values can be cut at any position, a recurrent state only
where it was taken: for a model with recurrent layers an entry is reused only when all of it is a
prefix of the new prompt, and a longer partial match it had to pass over is counted in
``partial_unusable``. Entries are evicted least recently used first once their bytes exceed the
budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from mlxr_core.model.cache import LayerCache

#: Prefixes shorter than this are not worth a lookup's copy.
MIN_REUSE = 16


@attrs.define
class PrefixEntry:
    tokens: np.ndarray
    layers: list[tuple[mx.array, ...]]
    nbytes: int


@attrs.define
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    #: Lookups whose longest match ended part way into an entry that holds recurrent state (which
    #: can be resumed only at its end): that match was not reused.
    partial_unusable: int = 0


class PrefixCache:
    """Token-prefix -> per-layer KV arrays, LRU under ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_key = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, tokens: Sequence[int], *, limit: int, make_cache: Callable[[], list[Any]]
    ) -> tuple[int, list[Any] | None]:
        """The longest stored prefix of ``tokens`` (at most ``limit`` tokens) as fresh caches from
        ``make_cache`` (the model's)."""
        if not self._entries or limit < MIN_REUSE:
            self.stats.misses += 1
            return 0, None
        caches = make_cache()
        partial = all(type(cache).partial_reuse for cache in caches)
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best_key, best, passed_over = -1, 0, 0
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(query))
            differs = np.nonzero(entry.tokens[:n] != query[:n])[0]
            common = int(differs[0]) if differs.size else n
            if not partial and common < len(entry.tokens):
                passed_over = max(passed_over, common)
                continue
            if common > best:
                best_key, best = key, common
        if passed_over >= MIN_REUSE and passed_over > best:
            self.stats.partial_unusable += 1
        if best < MIN_REUSE:
            self.stats.misses += 1
            return 0, None
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.reused_tokens += best
        for cache, arrays in zip(caches, entry.layers, strict=True):
            cache.restore(arrays, best)
        return best, caches

    def store(self, tokens: Sequence[int], caches: list[LayerCache]) -> bool:
        """Keep a snapshot of ``caches`` (holding exactly ``tokens``) unless it is too short to
        reuse or exceeds the budget; whether it was kept."""
        if len(tokens) < MIN_REUSE or self.max_bytes <= 0:
            return False
        layers = [cache.snapshot() for cache in caches]
        nbytes = sum(array.nbytes for layer in layers for array in layer)
        if nbytes > self.max_bytes:
            return False
        tokens_array = np.asarray(tokens, dtype=np.int64)
        for key, entry in list(self._entries.items()):  # a stored prefix of this one is redundant
            if len(entry.tokens) <= len(tokens_array) and np.array_equal(
                entry.tokens, tokens_array[: len(entry.tokens)]
            ):
                del self._entries[key]
        mx.eval([array for layer in layers for array in layer])
        self._entries[self._next_key] = PrefixEntry(tokens_array, layers, nbytes)
        self._next_key += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
            self.stats.evictions += 1
        return True
