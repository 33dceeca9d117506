"""Reuse of prompt KV state across requests that share a token prefix.

After a prompt is prefilled, its per-layer keys and values are stored under its token ids. A new
request takes the entry with the longest common prefix (a system prompt, the earlier turns of a
conversation, the same document) and prefills only the rest. Entries are evicted least recently
used first once their bytes exceed the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from mlxr_core.model.cache import KVCache

#: Prefixes shorter than this are not worth a lookup's copy.
MIN_REUSE = 16


@attrs.define
class PrefixEntry:
    tokens: np.ndarray
    layers: list[tuple[mx.array, mx.array]]
    nbytes: int


@attrs.define
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0


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

    def lookup(self, tokens: Sequence[int], *, limit: int) -> tuple[int, list[KVCache] | None]:
        """The longest stored prefix of ``tokens`` (at most ``limit`` tokens) as fresh caches."""
        if not self._entries or limit < MIN_REUSE:
            self.stats.misses += 1
            return 0, None
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best_key, best = -1, 0
        for key, entry in self._entries.items():
            n = min(len(entry.tokens), len(query))
            differs = np.nonzero(entry.tokens[:n] != query[:n])[0]
            common = int(differs[0]) if differs.size else n
            if common > best:
                best_key, best = key, common
        if best < MIN_REUSE:
            self.stats.misses += 1
            return 0, None
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.reused_tokens += best
        caches = [KVCache.from_arrays(k[..., :best, :], v[..., :best, :]) for k, v in entry.layers]
        return best, caches

    def store(self, tokens: Sequence[int], caches: list[KVCache]) -> None:
        """Keep a copy of ``caches`` (holding exactly ``tokens``) unless it exceeds the budget."""
        if len(tokens) < MIN_REUSE or self.max_bytes <= 0:
            return
        layers = []
        for cache in caches:
            assert cache.keys is not None and cache.values is not None
            # Copies, so the running request's buffers stay unshared (and writable in place).
            layers.append(
                (mx.contiguous(cache.keys[..., : cache.offset, :]), mx.contiguous(cache.values[..., : cache.offset, :]))
            )
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.max_bytes:
            return
        tokens_array = np.asarray(tokens, dtype=np.int64)
        for key, entry in list(self._entries.items()):  # a stored prefix of this one is redundant
            if len(entry.tokens) <= len(tokens_array) and np.array_equal(
                entry.tokens, tokens_array[: len(entry.tokens)]
            ):
                del self._entries[key]
        mx.eval([array for pair in layers for array in pair])
        self._entries[self._next_key] = PrefixEntry(tokens_array, layers, nbytes)
        self._next_key += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
            self.stats.evictions += 1
