"""A cache of streamed experts holding at most a fixed number of bytes, its eviction a policy.

Entries are one expert of one layer (``(layer, expert)``), each the MLX arrays of its three
projections. A policy only orders the keys; the cache counts bytes. The experts one layer's step
uses are pinned while it runs, so a step whose experts alone exceed the budget still runs (the
cache goes over for that step and evicts down to the budget after).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

import mlx.core as mx

#: One expert of one layer: ``(layer, expert)``.
ExpertKey = tuple[int, int]
#: One expert's arrays by parameter (``gate_proj.weight``, ``gate_proj.scales`` ...).
Entry = dict[str, mx.array]


class CachePolicy(Protocol):
    """Which cached expert is evicted first. Told of every use and insertion; asked for a victim."""

    def used(self, key: ExpertKey) -> None:
        """``key`` was inserted or read from the cache."""
        ...

    def removed(self, key: ExpertKey) -> None:
        """``key`` left the cache."""
        ...

    def victim(self, pinned: set[ExpertKey]) -> ExpertKey | None:
        """The cached key to evict next, never one of ``pinned``; None when only pinned remain."""
        ...


class LeastRecentlyUsed:
    """Evict the expert used longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def used(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def removed(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: set[ExpertKey]) -> ExpertKey | None:
        return next((key for key in self._order if key not in pinned), None)


class LeastFrequentlyUsed:
    """Evict the expert used least often while cached; among equals, the one used longest ago."""

    def __init__(self) -> None:
        self._uses: Counter[ExpertKey] = Counter()
        self._last: dict[ExpertKey, int] = {}
        self._clock = itertools.count()

    def used(self, key: ExpertKey) -> None:
        self._uses[key] += 1
        self._last[key] = next(self._clock)

    def removed(self, key: ExpertKey) -> None:
        self._uses.pop(key, None)
        self._last.pop(key, None)

    def victim(self, pinned: set[ExpertKey]) -> ExpertKey | None:
        free = [key for key in self._last if key not in pinned]
        return min(free, key=lambda key: (self._uses[key], self._last[key])) if free else None


#: ``models[].experts.policy`` -> a fresh policy.
POLICIES: dict[str, Callable[[], CachePolicy]] = {"lru": LeastRecentlyUsed, "lfu": LeastFrequentlyUsed}


class ExpertCache:
    """Experts by key, at most ``capacity`` bytes of them but for pinned ones."""

    def __init__(self, capacity: int, policy: CachePolicy) -> None:
        self.capacity, self.policy = capacity, policy
        self._entries: dict[ExpertKey, tuple[Entry, int]] = {}
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: ExpertKey) -> Entry | None:
        """The entry of ``key`` (a use, for the policy), or None."""
        found = self._entries.get(key)
        if found is None:
            return None
        self.policy.used(key)
        return found[0]

    def put(self, key: ExpertKey, entry: Entry, pinned: Iterable[ExpertKey] = ()) -> None:
        """Insert ``entry`` and evict others (never ``pinned`` nor ``key``) down to the capacity."""
        size = sum(array.nbytes for array in entry.values())
        if key in self._entries:
            self.nbytes -= self._entries[key][1]
        self._entries[key] = (entry, size)
        self.nbytes += size
        self.policy.used(key)
        self.shrink({key, *pinned})

    def shrink(self, pinned: set[ExpertKey]) -> None:
        """Evict down to the capacity, keeping ``pinned``."""
        while self.nbytes > self.capacity:
            victim = self.policy.victim(pinned)
            if victim is None:
                return
            self.nbytes -= self._entries.pop(victim)[1]
            self.policy.removed(victim)
            self.evictions += 1
