"""Reuse of prompt cache state across requests that share a token prefix.

After a prompt is prefilled, each layer's cache snapshot (keys and values; a recurrent layer's
state at the prompt's end) is stored under its token ids. A new request takes the entry with the
longest common prefix (a system prompt, the earlier turns of a conversation, the same document)
and prefills only the rest. Keys and values can be cut at any position, a recurrent state only
where it was taken: for a model with recurrent layers an entry is reused only when all of it is a
prefix of the new prompt, and a longer partial match it had to pass over is counted in
``partial_unusable``. Entries are evicted least recently used first once their bytes exceed the
budget; with a disk tier (:mod:`mlxr_core.engine.prefix_disk`) they spill to it instead of being
lost, and a lookup whose longest match is on disk loads it back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from mlxr_core.engine.prefix_disk import DiskPrefixStore
from mlxr_core.model.cache import LayerCache

#: Prefixes shorter than this are not worth a lookup's copy.
MIN_REUSE = 16


@attrs.define
class PrefixEntry:
    tokens: np.ndarray
    layers: list[tuple[mx.array, ...]]
    nbytes: int
    #: The disk tier's file holding the same entry (it came from there), or None.
    disk_file: str | None = None


@attrs.define
class PrefixStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    #: Lookups whose longest match ended part way into an entry that holds recurrent state (which
    #: can be resumed only at its end): that match was not reused.
    partial_unusable: int = 0
    #: The disk tier: lookups served from it, entries written, entries not written (queue full or
    #: larger than its budget), files that failed their check, entries evicted, bytes held.
    disk_hits: int = 0
    disk_writes: int = 0
    disk_drops: int = 0
    disk_quarantined: int = 0
    disk_evictions: int = 0
    disk_bytes: int = 0


class PrefixCache:
    """Token-prefix -> per-layer KV arrays, LRU under ``max_bytes``, evicted entries spilling to
    ``disk`` where given."""

    def __init__(self, max_bytes: int, disk: DiskPrefixStore | None = None):
        self.max_bytes = max_bytes
        self.disk = disk
        self._stats = PrefixStats()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_key = 0

    @property
    def stats(self) -> PrefixStats:
        if self.disk is not None:
            counters = self.disk.counters
            self._stats.disk_writes, self._stats.disk_drops = counters.writes, counters.drops
            self._stats.disk_quarantined, self._stats.disk_evictions = counters.quarantined, counters.evictions
            self._stats.disk_bytes = counters.nbytes
        return self._stats

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, tokens: Sequence[int], *, limit: int, make_cache: Callable[[], list[Any]]
    ) -> tuple[int, list[Any] | None]:
        """The longest stored prefix of ``tokens`` (at most ``limit`` tokens) as fresh caches from
        ``make_cache`` (the model's), from memory or else from the disk tier."""
        disk_entries = self.disk.entries() if self.disk is not None else []
        if (not self._entries and not disk_entries) or limit < MIN_REUSE:
            self._stats.misses += 1
            return 0, None
        caches = make_cache()
        partial = all(type(cache).partial_reuse for cache in caches)
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best_key, best, passed_over = longest_match(
            ((key, entry.tokens) for key, entry in self._entries.items()), query, partial
        )
        disk_key, on_disk, disk_passed = longest_match(
            ((entry.file, entry.tokens) for entry in disk_entries), query, partial
        )
        passed_over = max(passed_over, disk_passed)
        layers = self._entries[best_key].layers if best_key is not None else None
        restored = False
        if on_disk > best and on_disk >= MIN_REUSE and self.disk is not None:
            found = next(entry for entry in disk_entries if entry.file == disk_key)
            loaded = self.disk.load(found)
            if loaded is not None and self._restored(caches, loaded, on_disk):
                self._stats.disk_hits += 1
                self._insert(found.tokens, loaded, found.nbytes, disk_file=found.file)
                layers, best, best_key, restored = loaded, on_disk, None, True
            elif loaded is not None:
                self.disk.quarantine(found, "does not fit this model's caches")
                caches = make_cache()  # the failed restore may have filled some layers
        if passed_over >= MIN_REUSE and passed_over > best:
            self._stats.partial_unusable += 1
        if best < MIN_REUSE or layers is None:
            self._stats.misses += 1
            return 0, None
        if best_key in self._entries:
            self._entries.move_to_end(best_key)
        self._stats.hits += 1
        self._stats.reused_tokens += best
        if not restored:
            for cache, arrays in zip(caches, layers, strict=True):
                cache.restore(arrays, best)
        return best, caches

    @staticmethod
    def _restored(caches: list[Any], layers: list[tuple[mx.array, ...]], length: int) -> bool:
        """Restore a disk entry's ``layers`` into ``caches``; False where they do not fit (a file
        that passed its checks may still hold arrays of another count or shape: the lookup then
        goes on without it)."""
        try:
            for cache, arrays in zip(caches, layers, strict=True):
                cache.restore(arrays, length)
        except Exception:
            return False
        return True

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
        self._insert(tokens_array, layers, nbytes)
        return True

    def _insert(
        self, tokens: np.ndarray, layers: list[tuple[mx.array, ...]], nbytes: int, disk_file: str | None = None
    ) -> None:
        """Keep an entry (the newest), evicting (and spilling) the least recently used past the
        budget, unless it alone exceeds the budget."""
        if nbytes > self.max_bytes:
            return
        self._entries[self._next_key] = PrefixEntry(tokens, layers, nbytes, disk_file)
        self._next_key += 1
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._stats.evictions += 1
            self._spill(evicted)

    def _spill(self, entry: PrefixEntry, *, block: bool = False) -> None:
        if self.disk is None:
            return
        if entry.disk_file is not None:  # already there
            self.disk.touch(entry.disk_file)
        else:
            self.disk.put(entry.tokens, entry.layers, block=block)

    def close(self) -> None:
        """At shutdown, on the engine thread: write the entries still in memory to the disk tier
        (waiting for room in its queue) and stop its writer."""
        if self.disk is None:
            return
        for entry in reversed(self._entries.values()):  # most recently used first
            self._spill(entry, block=True)
        self._entries.clear()
        self.disk.close()


def longest_match(
    entries: Iterable[tuple[Any, np.ndarray]], query: np.ndarray, partial: bool
) -> tuple[Any, int, int]:
    """(key, length) of the entry sharing the longest prefix with ``query`` (``partial``: an
    entry may be cut; else only whole entries count), and the longest match passed over."""
    best_key, best, passed_over = None, 0, 0
    for key, tokens in entries:
        n = min(len(tokens), len(query))
        differs = np.nonzero(tokens[:n] != query[:n])[0]
        common = int(differs[0]) if differs.size else n
        if not partial and common < len(tokens):
            passed_over = max(passed_over, common)
            continue
        if common > best:
            best_key, best = key, common
    return best_key, best, passed_over


def adapter_key(tokens: Sequence[int] | np.ndarray, adapter: str) -> np.ndarray:
    """``tokens`` (a prompt as the cache keys it) under a LoRA adapter's mark: each token id plus
    a number taken from the adapter's name (ids are below 2**32; an image's negative mark is kept),
    so prompts served with different adapters share no prefix."""
    key = np.asarray(tokens, dtype=np.int64).copy()
    key[key >= 0] += (int(hashlib.sha256(adapter.encode()).hexdigest()[:6], 16) + 1) << 32
    return key
