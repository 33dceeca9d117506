"""Per-layer key/value caches.

One cache object per attention layer and sequence. The attention layer calls
:meth:`KVCache.update_and_fetch` with the keys and values of the new positions and attends over what
it returns; the decoder reads :attr:`KVCache.offset` (positions held) and evaluates
:attr:`KVCache.state` after a prefill chunk. Sliding-window and batched caches subclass
:class:`KVCache` and keep the same surface.
"""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys and values of one layer, ``[B, H, S, D]``, grown in steps of :attr:`step` positions.

    The buffers are pre-allocated so a decode step writes one position in place instead of
    concatenating (which would copy the whole cache every token).
    """

    #: Positions added each time the buffers grow.
    step: int = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        #: Number of valid positions.
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (``[B, H, L, D]``) and return every valid position so far."""
        start, length = self.offset, keys.shape[2]
        if self.keys is None or self.values is None or start + length > self.keys.shape[2]:
            self._grow(keys, values, start + length)
        assert self.keys is not None and self.values is not None
        self.offset = start + length
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        capacity = -(-needed // self.step) * self.step
        batch, heads, _, k_dim = keys.shape
        new_keys = mx.zeros((batch, heads, capacity, k_dim), dtype=keys.dtype)
        new_values = mx.zeros((batch, heads, capacity, values.shape[3]), dtype=values.dtype)
        if self.keys is not None and self.values is not None and self.offset > 0:
            new_keys[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_values[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_keys, new_values

    @property
    def state(self) -> list[mx.array]:
        """The arrays holding the cache (to evaluate after a prefill chunk); empty when unused."""
        if self.keys is None or self.values is None:
            return []
        return [self.keys, self.values]

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` can drop positions (a rotating window cache could not)."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (rejected draft tokens); return how many were dropped."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the buffers (not only the valid positions)."""
        return sum(array.nbytes for array in self.state)

    def __len__(self) -> int:
        return self.offset
